"""Batch benchmark: adaptive-concurrency throughput against the pool's measured maximum, and the work
redone when a job is killed and resumed.

Steps, on a throwaway stack (Tansu, Redis, moto S3, ``--replicas`` simulator replicas at ``--time-scale``):

1. maximum: the same job on a prefix of the input (``--baseline-records``) at fixed concurrencies
   that saturate the pool (1x and 2x replicas x max_batch); the best steady-state rate is the pool's
   measured maximum. The batch path itself is in the loop, so the maximum includes its own costs.
2. adaptive: the whole input (``--records``) with AIMD starting from 16 calls; rate over the whole
   job (ramp-up included) and in steady state, against the maximum.
3. kill: the whole input again, as a ``shopper batch submit`` process SIGKILLed halfway, then resumed.
   Records redone = records the worker had finished at the kill (its live progress, bounded up by its
   rate over the progress' age) minus the records in the parts already written, which a resume keeps;
   extra calls = LLM calls the replicas served beyond what the job needed (simulator counters), which
   also counts the calls in flight at the kill.

Rates are LLM calls per second (a split product costs several calls; both runs see the same mix) and
records per second. Prints tables and the machine; writes bench/results/batch.json and batch.png
(limit and rate over time in the adaptive run), or batch_quick.json and .png with ``--quick``.

Usage:
  .venv/bin/python -m bench.batch                      # the documented run (about 10 minutes)
  .venv/bin/python -m bench.batch --quick              # smoke run (about 2 minutes)
  .venv/bin/python -m bench.batch --records 100000 --skip-kill
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from batch.admin import prepare_resume, submit_job
from batch.config import BatchSettings
from batch.coordination import read_progress
from batch.launch import BatchRuntime, batch_client_config, open_batch
from batch.storage import JobStore, S3Uri
from batch.synthetic import synthetic_product_lines
from bench.common import REPO, machine, print_table, results_dir, temporary_stack
from devstack.stack import StackState, sink_settings

RESULTS = results_dir()
MAX_BATCH = 64  # the simulator's default max_batch (trtllm max_batch_size)


@dataclass
class RunResult:
    name: str
    concurrency: str
    records: int
    calls: int
    wall_s: float
    calls_per_s: float
    records_per_s: float
    steady_calls_per_s: float
    gpu_busy_pct: float
    """Simulated GPU time spent / (wall x replicas): 100% = every replica iterating all the time."""
    series: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since start, calls completed, limit) once a second."""


def _engines(stack: StackState) -> list[dict[str, Any]]:
    engines = []
    for url in stack.llm_endpoints:
        with urllib.request.urlopen(url + "/admin/stats", timeout=5) as response:
            engines.append(json.load(response)["engine"])
    return engines


def _served(stack: StackState) -> int:
    return sum(e["served"] + e["aborted"] for e in _engines(stack))


def _busy_ms(stack: StackState) -> float:
    """Simulated GPU time the replicas spent (all of them, before the time scale)."""
    return float(sum(e["busy_ms"] for e in _engines(stack)))


def _steady_rate(series: list[tuple[float, int, int]], lo: float = 0.2, hi: float = 0.9) -> float:
    """Calls per second between the samples where lo and hi of the run's calls were done."""
    total = series[-1][1]
    if total == 0:
        return 0.0
    start = next(s for s in series if s[1] >= lo * total)
    end = next(s for s in series if s[1] >= hi * total)
    return (end[1] - start[1]) / max(end[0] - start[0], 1e-9)


async def _run_job(
    runtime: BatchRuntime,
    stack: StackState,
    time_scale: float,
    input_uri: str,
    output_uri: str,
    name: str,
    concurrency: str,
) -> RunResult:
    manifest = await submit_job(runtime.store, input_uri, output_uri)
    busy_before = _busy_ms(stack)
    pool = runtime.pool
    series: list[tuple[float, int, int]] = []
    started = time.monotonic()
    base = pool.completed

    async def sample() -> None:
        while True:
            series.append((time.monotonic() - started, pool.completed - base, pool.limit))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    try:
        (final,) = await runtime.worker().run([manifest.job_id])
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    wall = time.monotonic() - started
    series.append((wall, pool.completed - base, pool.limit))
    busy_pct = 100 * (_busy_ms(stack) - busy_before) / 1000 * time_scale / (wall * len(stack.llm_endpoints))
    assert final.state == "succeeded", final.message
    calls = pool.completed - base
    result = RunResult(
        name,
        concurrency,
        final.records_done,
        calls,
        round(wall, 2),
        round(calls / wall, 1),
        round(final.records_done / wall, 1),
        round(_steady_rate(series), 1),
        round(busy_pct, 1),
        series,
    )
    print(
        f"  {name:<10} {concurrency:>10}: {final.records_done} records, {calls} calls in {wall:.1f} s -> "
        f"{result.calls_per_s:.1f} calls/s overall, {result.steady_calls_per_s:.1f} steady, "
        f"simulated GPUs {busy_pct:.0f}% busy",
        flush=True,
    )
    return result


async def _kill_and_resume(
    stack: StackState, stack_dir: Path, settings: BatchSettings, prefix: str, input_uri: str, records: int
) -> dict[str, Any]:
    sinks = sink_settings(stack, redis_key_prefix=prefix)
    job_id = f"bench-kill-{int(time.time())}"
    output = f"s3://{sinks.s3_bucket}/bench-batch/{job_id}"
    served_before = _served(stack)
    env = {
        **os.environ,
        "SINK_REDIS_KEY_PREFIX": prefix,
        "BATCH_LEASE_TTL_S": str(settings.lease_ttl_s),
        "BATCH_CHECKPOINT_INTERVAL_S": "0.2",  # fresher live progress: what was done at the kill
    }
    argv = [
        sys.executable, "-m", "shopper", "batch", "submit", "--input", input_uri, "--output", output,
        "--job-id", job_id, "--state-dir", str(stack_dir),
    ]  # fmt: skip
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{job_id}.log"
    with log_path.open("wb") as log:
        worker = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env=env, stdout=log, stderr=log)
    redis = aioredis.Redis.from_url(stack.redis_url)
    async with JobStore(sinks, settings.jobs_prefix) as store:
        started = time.monotonic()
        try:
            while True:
                await asyncio.sleep(0.2)
                if worker.returncode is not None:
                    raise RuntimeError(f"the worker exited early: {log_path.read_text()[-2000:]}")
                progress = await read_progress(redis, prefix, job_id)
                if progress and progress["done"] >= records // 2:
                    break
            # Records the worker had finished (committed or not) at the kill: its last published
            # progress, plus what it can have finished since at its rate (an upper bound).
            progress = await read_progress(redis, prefix, job_id) or {}
            worker.send_signal(signal.SIGKILL)
            killed_at = time.time()
            await worker.wait()
        finally:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
            await redis.aclose()
        first_run_s = time.monotonic() - started
        age_s = max(killed_at - progress.get("published_at", killed_at), 0.0)
        done_at_kill = progress.get("done", 0) + progress.get("rate", 0.0) * age_s
        killed = await store.read_manifest(job_id)
        # What a resume keeps: checkpointed shards plus parts written after the last checkpoint.
        written = await store.written_shards(S3Uri.parse(output), job_id)
        kept = sum(c.ok + c.errors for c in written.values())
        await prepare_resume(store, job_id)
    llm = batch_client_config(stack.llm_endpoints, stack.model, settings)
    async with open_batch(settings, sinks, llm) as runtime:
        resumed_at = time.monotonic()
        (final,) = await runtime.worker().run([job_id])  # waits out the killed worker's lease
        second_run_s = time.monotonic() - resumed_at
    spent = _served(stack) - served_before
    assert final.state == "succeeded", final.message
    redone = spent - final.requests
    log_path.unlink(missing_ok=True)
    return {
        "records": final.records_done,
        "checkpointed_at_kill": killed.records_done,
        "kept_at_kill": kept,
        "done_at_kill": round(done_at_kill),
        "progress_age_s": round(age_s, 3),
        "records_redone": max(round(done_at_kill) - kept, 0),
        "records_redone_pct": round(100 * max(done_at_kill - kept, 0) / final.records_done, 3),
        "first_run_s": round(first_run_s, 1),
        "resume_run_s": round(second_run_s, 1),
        "calls_needed": final.requests,
        "calls_spent": spent,
        "calls_redone": redone,
        "calls_redone_pct": round(100 * redone / final.requests, 3),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = BatchSettings()
    prefix = f"bench-batch-{int(time.time())}:"
    load_before = os.getloadavg()
    with temporary_stack(replicas=args.replicas, time_scale=args.time_scale) as stack:
        stack_dir = Path(stack.processes[0].log).parent.parent
        sinks = sink_settings(stack, redis_key_prefix=prefix)
        llm = batch_client_config(stack.llm_endpoints, stack.model, settings)
        lines = list(synthetic_product_lines(args.records, seed=11))
        full_uri = f"s3://{sinks.s3_bucket}/bench-batch/input-{args.records}.jsonl"
        base_uri = f"s3://{sinks.s3_bucket}/bench-batch/input-{args.baseline_records}.jsonl"
        async with JobStore(sinks, settings.jobs_prefix) as store:
            await store.put(S3Uri.parse(full_uri), b"\n".join(lines) + b"\n", "application/x-ndjson")
            await store.put(
                S3Uri.parse(base_uri),
                b"\n".join(lines[: args.baseline_records]) + b"\n",
                "application/x-ndjson",
            )
        del lines
        runs: list[RunResult] = []
        print(f"maximum: fixed concurrency on {args.baseline_records} records", flush=True)
        for factor in (1, 2):
            concurrency = factor * args.replicas * MAX_BATCH
            async with open_batch(settings, sinks, llm, fixed_limit=concurrency) as runtime:
                out = f"s3://{sinks.s3_bucket}/bench-batch/out-fixed-{concurrency}"
                runs.append(
                    await _run_job(runtime, stack, args.time_scale, base_uri, out, "fixed", str(concurrency))
                )
        print(f"adaptive: AIMD on {args.records} records", flush=True)
        async with open_batch(settings, sinks, llm) as runtime:
            out = f"s3://{sinks.s3_bucket}/bench-batch/out-aimd"
            adaptive = await _run_job(runtime, stack, args.time_scale, full_uri, out, "adaptive", "AIMD")
            decisions = list(runtime.pool.decisions)
        kill = None
        if not args.skip_kill:
            print(f"kill: {args.records} records, SIGKILL at half, resume", flush=True)
            kill = await _kill_and_resume(stack, stack_dir, settings, prefix, full_uri, args.records)
        with contextlib.suppress(Exception):
            import redis as sync_redis

            client = sync_redis.Redis.from_url(stack.redis_url)
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            for i in range(0, len(keys), 1000):
                client.delete(*keys[i : i + 1000])
    maximum = max(r.steady_calls_per_s for r in runs)

    def ratio(calls_per_s: float) -> float | None:
        """Against the maximum; none where the fixed runs were too short for a steady state (rate 0)."""
        return round(calls_per_s / maximum, 3) if maximum > 0 else None

    return {
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "records": args.records,
        "baseline_records": args.baseline_records,
        "fixed_runs": [asdict(r) for r in runs],
        "adaptive": asdict(adaptive),
        "max_calls_per_s": maximum,
        "ratio_overall": ratio(adaptive.calls_per_s),
        "ratio_steady": ratio(adaptive.steady_calls_per_s),
        "aimd_decisions": decisions[-50:],
        "kill": kill,
    }


def report(result: dict[str, Any]) -> None:
    loads = f"{result['load_average_before']} -> {result['load_average_after']}"
    print(f"\nmachine: {result['machine']}; load average {loads}")
    print(f"{result['replicas']} simulator replicas at time scale {result['time_scale']}\n")
    rows = [
        [r["name"], r["concurrency"], r["records"], r["calls"], r["wall_s"], r["calls_per_s"],
         r["steady_calls_per_s"], r["records_per_s"], r["gpu_busy_pct"]]
        for r in [*result["fixed_runs"], result["adaptive"]]
    ]  # fmt: skip
    print_table(
        [
            "run",
            "concurrency",
            "records",
            "LLM calls",
            "wall s",
            "calls/s",
            "steady calls/s",
            "records/s",
            "GPU busy %",
        ],
        rows,
    )
    if result["ratio_overall"] is None:
        print("\nadaptive / measured maximum: no steady state measured (runs too short)")
    else:
        print(
            f"\nadaptive / measured maximum: {result['ratio_overall']:.3f} over the whole job (ramp-up in), "
            f"{result['ratio_steady']:.3f} in steady state (maximum {result['max_calls_per_s']:.1f} calls/s)"
        )
    kill = result["kill"]
    if kill:
        print()
        print_table(
            ["records", "done at kill", "kept (written)", "records redone", "redone %", "calls needed",
             "calls spent", "extra calls", "extra calls %"],
            [[kill["records"], kill["done_at_kill"], kill["kept_at_kill"], kill["records_redone"],
              kill["records_redone_pct"], kill["calls_needed"], kill["calls_spent"], kill["calls_redone"],
              kill["calls_redone_pct"]]],
        )  # fmt: skip
        print(
            "records redone: finished before the kill but in shards not yet written; extra calls also count "
            "the calls in flight at the kill (their records had not finished)"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["adaptive"]["series"]
    t = [s[0] for s in series]
    rate = [0.0] + [(b[1] - a[1]) / max(b[0] - a[0], 1e-9) for a, b in itertools.pairwise(series)]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, rate, label="adaptive: calls/s (1 s)", color="tab:blue")
    ax.axhline(result["max_calls_per_s"], color="tab:green", linestyle="--", label="measured maximum")
    ax.axhline(0.9 * result["max_calls_per_s"], color="tab:green", linestyle=":", label="90% of maximum")
    ax.set_xlabel("seconds")
    ax.set_ylabel("LLM calls / s")
    ax2 = ax.twinx()
    ax2.plot(t, [s[2] for s in series], color="tab:orange", label="AIMD limit (calls in flight)")
    ax2.set_ylabel("concurrency limit")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="lower right", fontsize=8)
    scale = result["time_scale"]
    ax.set_title(f"batch: {result['records']} records, {result['replicas']} replicas, time scale {scale}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=None, help="default 30,000 (--quick: 5,000)")
    parser.add_argument("--baseline-records", type=int, default=None, help="default 8,000 (--quick: 2,000)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 5,000 records, 2,000 for the maximum (an explicit --records or --baseline-records "
        "wins); writes batch_quick.json/.png unless --out is given",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results file stem under bench/results (default batch, or batch_quick with --quick)",
    )
    args = parser.parse_args()
    if args.records is None:
        args.records = 5_000 if args.quick else 30_000
    if args.baseline_records is None:
        args.baseline_records = 2_000 if args.quick else 8_000
    if args.out is None:
        args.out = "batch_quick" if args.quick else "batch"  # a smoke run never overwrites the full run's
    result = asyncio.run(bench(args))
    report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.out}.png")
    print(f"\nwrote {RESULTS / args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
