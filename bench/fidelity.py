"""The simulator against TensorRT-LLM's published H100 throughput: ``python -m bench.fidelity [--short]``.

NVIDIA's performance overview (docs/simulator.md cites the page) lists the output throughput of
``trtllm-bench throughput``: every request queued at once, all with the same input and output length
(ISL/OSL), the engine's ``max_batch_size`` and ``max_num_tokens`` chosen by trtllm-bench's own heuristic
from the KV memory and the lengths. This script does the same with the simulator's engine in-process, on
its default cost model and capacity policy, in simulated time (no sleeping: the engine's clock is its own
GPU time), and compares tokens per second with the published figure.

``--short`` runs four figures with fewer requests (seconds); the full run takes every figure and the
published request counts capped at six batches. Results go to ``bench/results/fidelity.json``
(``fidelity_short.json`` for the short form).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass

from bench.common import machine, results_dir
from serving.simulator.config import SimulatorConfig
from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, GenerationRequest
from serving.simulator.hardware import GPUS, MODELS, GpuKind, WeightDtype
from serving.simulator.prefix_cache import BlockPrefixCache
from serving.simulator.replica import engine_limits, iteration_cost

SOURCE = "https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html"
SOURCE_MD = "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (Llama 3.1 8B table)"
BENCH_KV_FRACTION = 0.95
"""The page: "we also use a higher KV cache percentage by setting --kv_cache_free_gpu_mem_fraction 0.95"."""


@dataclass(frozen=True)
class Published:
    """One cell of the performance overview: output tokens/s of one GPU at ISL/OSL."""

    model: str
    gpu: GpuKind
    dtype: WeightDtype
    isl: int
    osl: int
    tokens_per_s: float
    requests: int
    """trtllm-bench's ``num_requests`` for these lengths (the page's table)."""


# Llama 3.1 8B, TP1, FP8 (nvidia/Llama-3.1-8B-Instruct-FP8), "Output Throughput per GPU (tokens/sec/GPU)".
PUBLISHED: tuple[Published, ...] = (
    Published("llama3-8b", "h100-80gb", "fp8", 128, 128, 28_312, 30_000),
    Published("llama3-8b", "h100-80gb", "fp8", 128, 2048, 22_714, 3_000),
    Published("llama3-8b", "h100-80gb", "fp8", 500, 2000, 17_660, 3_000),
    Published("llama3-8b", "h100-80gb", "fp8", 1000, 1000, 15_220, 3_000),
    Published("llama3-8b", "h100-80gb", "fp8", 2048, 128, 3_450, 3_000),
    Published("llama3-8b", "h100-80gb", "fp8", 2048, 2048, 9_305, 1_500),
    Published("llama3-8b", "h100-80gb", "fp8", 5000, 500, 3_459, 1_500),
    Published("llama3-8b", "h200-141gb", "fp8", 128, 2048, 26_221, 3_000),
    Published("llama3-8b", "h200-141gb", "fp8", 2048, 128, 3_538, 3_000),
    Published("llama3-8b", "h200-141gb", "fp8", 1000, 1000, 17_744, 3_000),
)
SHORT = {(128, 128), (2048, 128), (1000, 1000), (5000, 500)}
"""The short form's figures (H100): the four corners of compute- and bandwidth-bound work."""


def trtllm_bench_settings(figure: Published) -> tuple[int, int]:
    """``max_batch_size`` and ``max_num_tokens`` as trtllm-bench picks them (its ``calc_engine_setting``
    and ``finetune_setting``): the requests of ISL+OSL tokens that fit in 95% of the memory left after the
    weights, capped at 4,096, rounded up; tokens = that batch x (1 + ISL/OSL), capped at 32,768."""
    model = MODELS[figure.model]
    free = GPUS[figure.gpu].memory_bytes - model.weight_bytes(figure.dtype)
    per_request = model.kv_bytes_per_token(figure.dtype) * (figure.isl + figure.osl)
    raw_bs = min(free * BENCH_KV_FRACTION / per_request, 4096)
    raw_tokens = min(raw_bs * (1 + figure.isl / figure.osl), 32768)
    if raw_bs < 256:
        batch = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        batch = 128 * math.ceil(raw_bs / 128)
    else:
        batch = 256 * math.ceil(raw_bs / 256)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return batch, tokens


@dataclass(frozen=True)
class Row:
    model: str
    gpu: str
    dtype: str
    isl: int
    osl: int
    requests: int
    max_batch: int
    max_num_tokens: int
    kv_blocks: int
    published_tokens_per_s: float
    simulated_tokens_per_s: float
    error: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    peak_running: int


async def simulate(figure: Published, requests: int) -> Row:
    """trtllm-bench's offline run on the simulator's engine, in simulated time."""
    batch, tokens = trtllm_bench_settings(figure)
    config = SimulatorConfig(
        calibration_model=figure.model,
        gpu=figure.gpu,
        weight_dtype=figure.dtype,
        free_gpu_memory_fraction=BENCH_KV_FRACTION,
        max_batch=batch,
        max_num_tokens=tokens,
        max_seq_len=figure.isl + figure.osl,
        time_scale=0.0,
    )
    engine_box: list[ContinuousBatchingEngine] = []
    engine = ContinuousBatchingEngine(
        iteration_cost(config),
        BlockPrefixCache(config.cache_capacity_blocks, config.block_size),
        engine_limits(config),
        EngineKnobs(time_scale=0.0),
        clock=lambda: engine_box[0].stats.busy_ms / 1000.0 if engine_box else 0.0,
    )
    engine_box.append(engine)
    # Random token ids in trtllm-bench's data set: no two prompts share a block.
    jobs = [
        GenerationRequest(
            f"q{i}",
            figure.isl,
            [i * 1_000_003 + b for b in range(figure.isl // config.block_size)],
            figure.osl,
            max_new_tokens=figure.osl,
        )
        for i in range(requests)
    ]
    for job in jobs:
        engine.submit(job)
    await asyncio.gather(*(job.done.wait() for job in jobs))
    makespan = max(job.finished_at or 0.0 for job in jobs)
    simulated = requests * figure.osl / makespan
    ttft = sum(job.ttft or 0.0 for job in jobs) / requests * 1000.0
    tpot = sum(
        ((job.finished_at or 0.0) - (job.first_token_at or 0.0)) / max(figure.osl - 1, 1) for job in jobs
    )
    return Row(
        model=figure.model,
        gpu=figure.gpu,
        dtype=figure.dtype,
        isl=figure.isl,
        osl=figure.osl,
        requests=requests,
        max_batch=batch,
        max_num_tokens=tokens,
        kv_blocks=config.cache_capacity_blocks,
        published_tokens_per_s=figure.tokens_per_s,
        simulated_tokens_per_s=round(simulated, 1),
        error=round(simulated / figure.tokens_per_s - 1.0, 4),
        mean_ttft_ms=round(ttft, 1),
        mean_tpot_ms=round(tpot / requests * 1000.0, 2),
        peak_running=_peak_running(jobs),
    )


def _peak_running(jobs: list[GenerationRequest]) -> int:
    """The most requests admitted and not yet finished at once (what the KV memory let run)."""
    edges = sorted(
        [(job.admitted_at or 0.0, 1) for job in jobs] + [(job.finished_at or 0.0, -1) for job in jobs],
        key=lambda e: (e[0], e[1]),
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def request_count(figure: Published, short: bool) -> int:
    """Enough requests for a steady state: the published count capped at six batches, or in the short
    form two batches (the errors move by under a point)."""
    batch, _ = trtllm_bench_settings(figure)
    if short:
        return min(figure.requests, 2 * batch)
    return min(figure.requests, 6 * batch)


def figures(short: bool) -> list[Published]:
    if not short:
        return list(PUBLISHED)
    return [f for f in PUBLISHED if (f.isl, f.osl) in SHORT and f.gpu == "h100-80gb"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__)
    parser.add_argument("--short", action="store_true", help="four figures, fewer requests (seconds)")
    parser.add_argument("--out", default=None, help="results JSON (default: under bench/results)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = [asyncio.run(simulate(f, request_count(f, args.short))) for f in figures(args.short)]
    print(f"machine: {machine()}; source: {SOURCE}")
    print("gpu        ISL/OSL    reqs  batch tokens  blocks  published  simulated   error  TTFT ms  TPOT ms")
    for r in rows:
        print(
            f"{r.gpu:<10} {r.isl:>5}/{r.osl:<5} {r.requests:>5} {r.max_batch:>5} {r.max_num_tokens:>6}"
            f" {r.kv_blocks:>7} {r.published_tokens_per_s:>10,.0f} {r.simulated_tokens_per_s:>10,.0f}"
            f" {r.error:>+7.1%} {r.mean_ttft_ms:>8,.0f} {r.mean_tpot_ms:>8.1f}"
        )
    worst = max(abs(r.error) for r in rows)
    print(f"largest error {worst:.1%}; {time.monotonic() - started:.1f} s")
    name = "fidelity_short.json" if args.short else "fidelity.json"  # a short run never overwrites the full
    out = results_dir() / name if args.out is None else args.out
    payload = {
        "source": SOURCE,
        "source_markdown": SOURCE_MD,
        "machine": machine(),
        "short": args.short,
        "rows": [asdict(r) for r in rows],
    }
    with open(out, "w") as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main()
