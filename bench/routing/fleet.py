"""The simulated cluster: replica processes, their capacity, and the TTFT floor of a trace on it."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.routing.consts import BLOCK, REPO
from bench.trace import (
    TraceRequest,
)
from devstack.served_process import ServedProcess, start_served
from llm_client import LLMClient
from prompt_assembly.tokens import chained_block_hashes, messages_text, token_ids


# ---- the cluster -----------------------------------------------------------------------------------
class SimFleet:
    """Simulator replicas as child processes of this benchmark."""

    def __init__(self, n: int, time_scale: float, coalesce_s: float, extra: Sequence[str] = ()) -> None:
        self.n, self.time_scale, self.coalesce_s = n, time_scale, coalesce_s
        self.extra = list(extra)
        self.replicas: list[ServedProcess] = []
        self.urls: list[str] = []

    async def __aenter__(self) -> SimFleet:
        started = await asyncio.gather(
            *(start_served(self._argv(i), root=REPO) for i in range(self.n)), return_exceptions=True
        )
        self.replicas = [r for r in started if isinstance(r, ServedProcess)]
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await self.__aexit__()
            raise failed[0]
        self.urls = [replica.url for replica in self.replicas]
        return self

    def _argv(self, i: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "serving.simulator",
            "--port",
            "0",
            "--replica-id",
            f"r{i}",
            "--time-scale",
            str(self.time_scale),
            "--stream-coalesce-s",
            str(self.coalesce_s),
            "--seed",
            str(i),
            *self.extra,
        ]

    def kill(self, i: int) -> None:
        self.replicas[i].process.send_signal(signal.SIGKILL)

    async def reset_cache(self, i: int) -> None:
        """Empty one replica's KV cache, as a restart would (it reports ``cleared`` when events are on)."""
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.urls[i] + "/admin/reset_cache") as response,
        ):
            response.raise_for_status()

    async def server_first_tokens(self) -> list[dict[str, Any]]:
        """Every request's first-token timeline as the replicas measured it (simulated ms: TTFT, queue
        wait, tokens prefilled in its iteration; the simulator's ``FirstTokenRecord``), with the replica's
        index, for exact server-side tails."""
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(_get_json(session, url + "/admin/ttft") for url in self.urls))
        return [
            {**record, "replica": i}
            for i, answer in enumerate(answers)
            if answer is not None
            for record in answer["requests"]
        ]

    async def stats(self) -> list[dict[str, Any] | None]:
        async with aiohttp.ClientSession() as session:
            return list(
                await asyncio.gather(*(_get_json(session, url + "/admin/stats") for url in self.urls))
            )

    async def server_ttft_ms(self) -> float | None:
        """Mean time to first token as the replicas measured it (no client or HTTP overhead), in simulated
        ms, from their Prometheus histograms."""
        total = count = 0.0
        async with aiohttp.ClientSession() as session:
            for url in self.urls:
                try:
                    async with session.get(
                        url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
                    ) as response:
                        text = await response.text()
                except (aiohttp.ClientError, TimeoutError):
                    continue
                for line in text.splitlines():
                    if line.startswith("sim_time_to_first_token_seconds_sum"):
                        total += float(line.split()[-1])
                    elif line.startswith("sim_time_to_first_token_seconds_count"):
                        count += float(line.split()[-1])
        return 1000.0 * total / count if count else None

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(replica.stop() for replica in self.replicas))


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            return dict(await response.json())
    except (aiohttp.ClientError, TimeoutError):
        return None


# ---- capacity --------------------------------------------------------------------------------------
async def measure_capacity(
    trace: Sequence[TraceRequest], n: int = 600, engine_options: dict[str, Any] | None = None
) -> float:
    """Saturation throughput (requests per simulated second) of ONE replica for this trace when every
    prompt reuses only the system-prompt head all prompts share (what cache-oblivious routing gets).

    Runs the simulator's own engine and cost model in-process at time scale 0 with a full queue, and
    takes the completion rate between the 25th and 75th percentile completions (steady state, batch full).
    ``engine_options``: the replicas' ``SimulatorConfig`` settings (e.g. chunked prefill), so utilisation
    is relative to the engine the replicas run.
    """
    from serving.simulator.config import SimulatorConfig
    from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, GenerationRequest
    from serving.simulator.prefix_cache import BlockPrefixCache
    from serving.simulator.replica import engine_limits, iteration_cost

    config = SimulatorConfig(**(engine_options or {}))
    cost = iteration_cost(config)
    cache = BlockPrefixCache(config.cache_capacity_blocks, config.block_size)
    engine = ContinuousBatchingEngine(cost, cache, engine_limits(config), EngineKnobs(time_scale=0.0))
    hashes = [chained_block_hashes(token_ids(messages_text(r.messages)), BLOCK) for r in trace[:n]]
    head = _common_prefix_blocks(
        hashes[0], next(h for h, r in zip(hashes, trace, strict=False) if r.shopper_id != trace[0].shopper_id)
    )
    rng = random.Random(0)
    jobs = []
    for i, (request, h) in enumerate(zip(trace[:n], hashes, strict=False)):
        salt = rng.getrandbits(63)
        unique = h[:head] + [x ^ salt for x in h[head:]]
        jobs.append(GenerationRequest(f"cap{i}", request.prompt_tokens, unique, request.max_tokens))
    for job in jobs:
        engine.submit(job)
    samples: list[tuple[int, float]] = []
    while engine.stats.served < len(jobs):
        await asyncio.sleep(0)
        samples.append((engine.stats.served, engine.stats.busy_ms))
    lo = next(ms for served, ms in samples if served >= len(jobs) // 4)
    hi = next(ms for served, ms in samples if served >= 3 * len(jobs) // 4)
    await engine.close()
    return (3 * len(jobs) // 4 - len(jobs) // 4) / ((hi - lo) / 1000.0)


def ttft_floor_ms(
    trace: Sequence[TraceRequest], batch: int, engine_options: dict[str, Any] | None = None
) -> tuple[float, float]:
    """Mean TTFT with no queueing at all: each request's first token comes after one iteration holding
    only its own prefill beside a decode batch of ``batch`` running requests, priced by the replicas' own
    cost model (``iteration_cost``: one fused pass on the default roofline). Returned for (a) the oracle's
    caching (a prompt reuses its shopper's previous prompt, or at least the shared system-prompt head) and
    (b) head-only caching (what a cache-oblivious router gets). No router can beat (a) on average."""
    from serving.simulator.config import SimulatorConfig
    from serving.simulator.cost_model import IterationWork
    from serving.simulator.replica import iteration_cost

    config = SimulatorConfig(**(engine_options or {}))
    cost = iteration_cost(config)
    mixed = config.mixed_batch_cost
    previous: dict[str, set[int]] = {}
    first: list[int] | None = None
    oracle_ms: list[float] = []
    head_ms: list[float] = []
    for request in trace:
        ids = token_ids(messages_text(request.messages))
        hashes = chained_block_hashes(ids, BLOCK)
        if first is None:
            first = hashes
        n = len(ids)
        head = min(_common_prefix_blocks(first, hashes) * BLOCK, n - 1)
        own = max(head, _held_prefix(hashes, previous.get(request.shopper_id, set()), n))
        oracle_ms.append(cost.iteration_ms(IterationWork(((n - own, own),), batch, batch * n), mixed))
        head_ms.append(cost.iteration_ms(IterationWork(((n - head, head),), batch, batch * n), mixed))
        previous[request.shopper_id] = set(hashes)
    return statistics.fmean(oracle_ms), statistics.fmean(head_ms)


def _held_prefix(hashes: Sequence[int], held: set[int], prompt_tokens: int) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return min(n * BLOCK, prompt_tokens - 1)


def _common_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-options``: ``SimulatorConfig`` settings every replica of every run gets (validated)."""
    from serving.simulator.config import SimulatorConfig

    options: dict[str, Any] = json.loads(args.engine_options)
    SimulatorConfig(**options)
    return options


def replica_kv_blocks(args: argparse.Namespace) -> int:
    """KV blocks of one replica as the fleet runs it: ``--engine-options``' ``cache_capacity_blocks``, or
    the simulator's own sizing from the GPU's memory (``SimulatorConfig``: 0 = from the hardware)."""
    from serving.simulator.config import SimulatorConfig

    return SimulatorConfig(**engine_options(args)).cache_capacity_blocks


def engine_flags(args: argparse.Namespace) -> list[str]:
    """``--engine-options`` as simulator command-line flags."""
    flags: list[str] = []
    for name, value in engine_options(args).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += ["--" + name.replace("_", "-"), text]
    return flags


async def _reset_later(fleet: SimFleet, replica: int, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await fleet.reset_cache(replica)


async def _kill_later(fleet: SimFleet, client: LLMClient, replica: int, delay_s: float) -> float:
    """SIGKILL one replica after ``delay_s``; returns the wall seconds until the client ejected it."""
    await asyncio.sleep(delay_s)
    fleet.kill(replica)
    killed = time.perf_counter()
    victim = client.endpoints[replica]
    while victim.healthy:
        await asyncio.sleep(0.005)
    return time.perf_counter() - killed
