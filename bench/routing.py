"""Routing benchmark: round_robin, least_outstanding, session_affinity and prefix_aware on a shopper trace.

Setups:
  sim    8 simulated trtllm-serve replicas (qwen2.5-32b H100 cost model), subprocesses, Poisson arrivals
         at several utilisations of the cache-oblivious capacity (measured on the simulator's engine).
  kill   the same at one utilisation with prefix_aware, one replica SIGKILLed halfway: lost requests and
         recovery.
  llama  3 llama-server replicas with Gemma 3 270M on this CPU: measured prompt-cache reuse vs the oracle.
  scenarios  stress shapes (skewed shoppers, on/off bursts, long sessions, eviction pressure, a cache
         reset), each against the baselines; ``--repeats N`` replays each N times with new arrival
         times and judges the targets on the pooled server-side TTFTs (p99 with a bootstrap interval).

Usage:
  .venv/bin/python -m bench.routing                      # everything (about 15 minutes on 2 cores)
  .venv/bin/python -m bench.routing --quick              # smoke run (about 2 minutes)
  .venv/bin/python -m bench.routing --setups sim --utilisations 0.7
  .venv/bin/python -m bench.routing --setups scenarios --shoppers 80 --time-scale 0.75 --repeats 2
  .venv/bin/python -m bench.routing --engine-options '{"enable_chunked_prefill": true}' ...  # replica flags
  .venv/bin/python -m bench.routing --combine a.json,b.json --tag _all   # pool separate scenario runs

Prints tables and the machine; writes bench/results/routing*.json and routing.png / routing_kill.png.
Times are reported in *simulated* milliseconds (wall / time scale) for the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.trace import (
    OracleBound,
    TraceConfig,
    TraceRequest,
    generate_trace,
    oracle_prefill,
    with_onoff_arrivals,
    with_poisson_arrivals,
)
from llm_client import ClientConfig, LLMClient
from llm_client.errors import LLMError
from llm_client.hooks import Attempt
from llm_client.routing.prefix_aware import PrefixAwarePolicy, PrefixAwareSettings
from prompt_assembly.tokens import chained_block_hashes, messages_text, token_ids

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
POLICIES = ("round_robin", "least_outstanding", "session_affinity", "prefix_aware")
BLOCK = 32


# ---- the cluster -----------------------------------------------------------------------------------
class SimFleet:
    """Simulator replicas as child processes of this benchmark."""

    def __init__(self, n: int, time_scale: float, coalesce_s: float, extra: Sequence[str] = ()) -> None:
        self.n, self.time_scale, self.coalesce_s = n, time_scale, coalesce_s
        self.extra = list(extra)
        self.processes: list[asyncio.subprocess.Process] = []
        self.urls: list[str] = []
        self._drains: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SimFleet:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for i in range(self.n):
            argv = [
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
            self.processes.append(
                await asyncio.create_subprocess_exec(
                    *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
                )
            )
        for process in self.processes:
            self.urls.append(await self._ready(process))
        return self

    async def _ready(self, process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        async with asyncio.timeout(60):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    raise RuntimeError("a simulator exited before READY")
                if line.startswith("READY "):
                    self._drains.append(asyncio.create_task(_drain(process.stdout)))
                    return line.split()[1]

    def kill(self, i: int) -> None:
        self.processes[i].send_signal(signal.SIGKILL)

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
        for process in self.processes:
            if process.returncode is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        for task in self._drains:
            task.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


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
    from serving.simulator.cost_model import CostModel
    from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, GenerationRequest
    from serving.simulator.prefix_cache import BlockPrefixCache
    from serving.simulator.replica import engine_limits

    config = SimulatorConfig(**(engine_options or {}))
    cost = CostModel.from_calibration(config.resolved_calibration_path(), config.calibration_model)
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


def ttft_floor_ms(trace: Sequence[TraceRequest], batch: int) -> tuple[float, float]:
    """Mean TTFT with no queueing at all: each request's first token comes after one iteration holding
    only its own prefill plus one decode step of ``batch`` running requests. Returned for (a) the oracle's
    caching (a prompt reuses its shopper's previous prompt, or at least the shared system-prompt head) and
    (b) head-only caching (what a cache-oblivious router gets). No router can beat (a) on average."""
    from serving.simulator.config import SimulatorConfig
    from serving.simulator.cost_model import CostModel

    config = SimulatorConfig()
    cost = CostModel.from_calibration(config.resolved_calibration_path(), config.calibration_model)
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
        step = cost.decode_step_ms(batch, batch * n)
        oracle_ms.append(cost.prefill_ms(n - own, own) + step)
        head_ms.append(cost.prefill_ms(n - head, head) + step)
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


# ---- one replay ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    shopper: str
    arrival_s: float
    done_s: float
    ok: bool
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    endpoint: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    attempts: int = 0
    error: str = ""


@dataclass
class RunResult:
    setup: str
    policy: str
    utilisation: float
    requests: int
    completed: int
    lost: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    server_ttft_mean_ms: float | None
    """The replicas' own mean TTFT: without the client's tokenising/hashing and HTTP overhead."""
    e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    prefill_tokens: int
    prefill_tokens_sim: int | None
    prompt_tokens: int
    cache_hit_ratio: float
    load_max_over_mean: float
    busy_max_over_mean: float | None
    retries: int
    drains: int
    restarts_detected: int
    oracle_prefill_tokens: int
    oracle_prefill_tokens_per_shopper: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    server_ttft_p50_ms: float | None = None
    server_ttft_p99_ms: float | None = None
    """Exact, from every request's TTFT as the replicas measured it: the router's effect without the
    client process's own CPU delays (which dominate client-side tails on a loaded 2-core machine)."""


def client_config(
    urls: Sequence[str],
    policy: str,
    *,
    attempt_s: float,
    deadline_s: float,
    options: dict[str, Any] | None = None,
    time_scale: float = 1.0,
) -> ClientConfig:
    """``policy`` is a policy name, ``prefix_aware_precise`` (prefix_aware following KV events) or
    ``prefix_aware_noguard`` (without the tail guards: hot-shopper spreading and the queue cap, as before
    they existed) or ``prefix_aware_spread`` (with hot-shopper spreading, off by default); ``options``
    are prefix_aware's settings (ignored for the others), passed as they are (a ``cobatch_window_s``
    there is wall time); ``time_scale`` is the replicas' (wall seconds per simulated second)."""
    settings: dict[str, Any] | None = None
    if policy.startswith("prefix_aware"):
        # The co-batching window is engine time: a simulated second lasts time_scale wall seconds.
        window = PrefixAwareSettings().cobatch_window_s * time_scale
        settings = {"cobatch_window_s": window, **(options or {}), "policy": "prefix_aware"}
        if policy == "prefix_aware_precise":
            settings["kv_events"] = "precise"
        if policy == "prefix_aware_noguard":
            settings.update(max_queued_tokens=1e12, hot_key_spread=False)
        if policy == "prefix_aware_spread":
            settings["hot_key_spread"] = True
        policy = "prefix_aware"
    return ClientConfig.model_validate(
        {
            "endpoints": list(urls),
            "policy": policy,
            "policy_settings": settings,
            "model": "bench",
            "max_in_flight": 4096,
            "stream": True,
            "timeouts": {"connect_s": 5.0, "attempt_s": attempt_s, "deadline_s": deadline_s},
            "health": {"interval_s": 0.5},
        }
    )


async def replay(
    client: LLMClient,
    trace: Sequence[TraceRequest],
    time_scale: float,
    *,
    sequential_per_shopper: bool = False,
    concurrency: int | None = None,
    extra_body: dict[str, Any] | None = None,
    on_progress: Any = None,
) -> list[Outcome]:
    """Send each request at its arrival time (simulated seconds x ``time_scale``); with
    ``sequential_per_shopper`` a shopper's next prompt also waits for its previous answer (closed loop)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    previous: dict[str, asyncio.Task[Outcome]] = {}

    async def one(request: TraceRequest, after: asyncio.Task[Outcome] | None) -> Outcome:
        if after is not None:
            await asyncio.wait([after])
        async with gate if gate is not None else contextlib.nullcontext():
            start = loop.time()
            arrival = (start - t0) / time_scale
            try:
                c = await client.chat(
                    request.messages,
                    routing_key=request.shopper_id,
                    max_tokens=request.max_tokens,
                    extra_body=extra_body,
                )
            except LLMError as exc:
                end = loop.time()
                return Outcome(request.shopper_id, arrival, (end - t0) / time_scale, False, error=repr(exc))
            end = loop.time()
            e2e = (end - start) * 1000.0
            ttft = e2e - (c.latency_ms - c.ttft_ms)  # includes retries and client-side time
            outcome = Outcome(
                request.shopper_id,
                arrival,
                (end - t0) / time_scale,
                True,
                ttft / time_scale,
                e2e / time_scale,
                c.endpoint,
                c.prompt_tokens,
                c.cached_tokens,
                c.attempts,
            )
            if on_progress is not None:
                on_progress(outcome)
            return outcome

    tasks: list[asyncio.Task[Outcome]] = []
    for request in trace:
        delay = t0 + request.t * time_scale - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        after = previous.get(request.shopper_id) if sequential_per_shopper else None
        task = asyncio.create_task(one(request, after))
        previous[request.shopper_id] = task
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


def summarise(
    setup: str,
    policy: str,
    utilisation: float,
    outcomes: Sequence[Outcome],
    client: LLMClient,
    oracle: OracleBound,
    stats: Sequence[dict[str, Any] | None] | None,
    wall_s: float,
    server_ttft: float | None = None,
) -> RunResult:
    ok = [o for o in outcomes if o.ok]
    ttft = sorted(o.ttft_ms for o in ok)
    e2e = sorted(o.e2e_ms for o in ok)
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    per_replica = Counter(o.endpoint for o in ok)
    loads = [per_replica.get(e.name, 0) for e in client.endpoints]
    span = max(o.done_s for o in ok) - min(o.arrival_s for o in outcomes) if ok else 0.0
    sim_prefill = busy_ratio = None
    if stats and all(s is not None for s in stats):
        engines = [s["engine"] for s in stats if s is not None]
        sim_prefill = sum(int(e["prefill_tokens_computed"]) for e in engines)
        busy = [float(e["busy_ms"]) for e in engines]
        busy_ratio = max(busy) / statistics.mean(busy) if statistics.mean(busy) > 0 else None
    return RunResult(
        setup=setup,
        policy=policy,
        utilisation=utilisation,
        requests=len(outcomes),
        completed=len(ok),
        lost=len(outcomes) - len(ok),
        ttft_mean_ms=statistics.fmean(ttft) if ttft else 0.0,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        server_ttft_mean_ms=server_ttft,
        e2e_mean_ms=statistics.fmean(e2e) if e2e else 0.0,
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        prefill_tokens=prompt - cached,
        prefill_tokens_sim=sim_prefill,
        prompt_tokens=prompt,
        cache_hit_ratio=cached / prompt if prompt else 0.0,
        load_max_over_mean=max(loads) / statistics.mean(loads) if loads and statistics.mean(loads) else 0.0,
        busy_max_over_mean=busy_ratio,
        retries=client.retries,
        drains=client.degradation.drains,
        restarts_detected=sum(e.restarts_detected for e in client.endpoints),
        oracle_prefill_tokens=oracle.prefill_tokens_global,
        oracle_prefill_tokens_per_shopper=oracle.prefill_tokens_per_shopper,
        wall_s=wall_s,
    )


def _pct(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-options``: ``SimulatorConfig`` settings every replica of every run gets (validated)."""
    from serving.simulator.config import SimulatorConfig

    options: dict[str, Any] = json.loads(args.engine_options)
    SimulatorConfig(**options)
    return options


def engine_flags(args: argparse.Namespace) -> list[str]:
    """``--engine-options`` as simulator command-line flags."""
    flags: list[str] = []
    for name, value in engine_options(args).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += ["--" + name.replace("_", "-"), text]
    return flags


# ---- setups ----------------------------------------------------------------------------------------
async def run_sim(
    policy: str,
    utilisation: float,
    trace: Sequence[TraceRequest],
    capacity_rps: float,
    oracle: OracleBound,
    args: argparse.Namespace,
    *,
    kill_at_fraction: float | None = None,
    timed: Sequence[TraceRequest] | None = None,
    fleet_args: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    reset_at_fraction: float | None = None,
    setup: str = "sim",
) -> tuple[RunResult, list[Outcome]]:
    """One replay on fresh replicas. ``timed``: the arrivals (default: Poisson at ``utilisation``);
    ``fleet_args``: extra simulator flags; ``options``: prefix_aware settings (default: the command
    line's); ``reset_at_fraction``: empty replica ``args.kill_replica``'s cache when that share of the
    prompts has arrived (a restart that keeps the process)."""
    if timed is None:
        timed = with_poisson_arrivals(trace, utilisation * capacity_rps, seed=args.seed)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    fleet_args = [*engine_flags(args), *fleet_args]
    async with SimFleet(args.replicas, args.time_scale, args.coalesce_s, fleet_args) as fleet:
        config = client_config(
            fleet.urls,
            policy,
            attempt_s=120 * args.time_scale + 10,
            deadline_s=300 * args.time_scale + 20,
            options=options if options is not None else json.loads(args.prefix_aware_options),
            time_scale=args.time_scale,
        )
        async with LLMClient(config, seed=args.seed) as client:
            await client.wait_until_healthy()
            attempt_errors = _count_attempt_errors(client)
            killer = resetter = None
            if kill_at_fraction is not None:
                kill_time = timed[int(len(timed) * kill_at_fraction)].t
                killer = asyncio.create_task(
                    _kill_later(fleet, client, args.kill_replica, kill_time * args.time_scale)
                )
            if reset_at_fraction is not None:
                reset_time = timed[int(len(timed) * reset_at_fraction)].t
                resetter = asyncio.create_task(
                    _reset_later(fleet, args.kill_replica, reset_time * args.time_scale)
                )
            outcomes = await replay(client, timed, args.time_scale, extra_body={"ignore_eos": True})
            eject_delay_s = (await killer) / args.time_scale if killer is not None else None
            if resetter is not None:
                await resetter
            stats = await fleet.stats()
            server_ttft = await fleet.server_ttft_ms()
            first_tokens = await fleet.server_first_tokens()
            server_ttfts = sorted(float(r["ttft_ms"]) for r in first_tokens)
            result = summarise(
                setup,
                policy,
                utilisation,
                outcomes,
                client,
                oracle,
                stats,
                time.perf_counter() - started,
                server_ttft,
            )
            # Other work on the machine distorts the replicas' clocks: keep the evidence with the result.
            result.extra["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            result.extra["attempt_errors"] = dict(attempt_errors)
            result.extra["windows"] = windows(outcomes)
            result.extra["tail"] = tail_report(outcomes, timed)
            result.extra["server_tail"] = server_tail_report(first_tokens)
            if server_ttfts:
                result.server_ttft_p50_ms = _pct(server_ttfts, 50)
                result.server_ttft_p99_ms = _pct(server_ttfts, 99)
                result.extra["server_ttfts_ms"] = [round(t, 1) for t in server_ttfts]
            if isinstance(client.policy, PrefixAwarePolicy):
                result.extra["policy_stats"] = asdict(client.policy.stats)
            if reset_at_fraction is not None:
                reset_s = timed[int(len(timed) * reset_at_fraction)].t
                result.extra["reset_at_s"] = reset_s
                result.extra["after_reset"] = _after_reset(
                    outcomes, reset_s, client.endpoints[args.kill_replica].name
                )
            if kill_at_fraction is not None:
                kill_s = timed[int(len(timed) * kill_at_fraction)].t
                result.extra.update(_kill_report(outcomes, kill_s, client, args))
                result.extra["ejected_after_s"] = eject_delay_s
    return result, outcomes


def _count_attempt_errors(client: LLMClient) -> Counter[str]:
    """Count why attempts failed (the client retries them silently), through the client's hooks."""
    errors: Counter[str] = Counter()

    def failed(attempt: Attempt, exc: LLMError) -> None:
        errors[f"{type(exc).__name__}: {str(exc)[:60]}"] += 1

    client.hooks.attempt_failed.append(failed)
    return errors


async def _reset_later(fleet: SimFleet, replica: int, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await fleet.reset_cache(replica)


def _after_reset(outcomes: Sequence[Outcome], reset_s: float, victim: str) -> dict[str, Any]:
    """What the reset cost: requests sent to the reset replica in the 20 simulated seconds after it,
    and how many of them found less than the shared head cached (routed on a belief the reset made
    stale)."""
    after = [o for o in outcomes if o.ok and o.endpoint == victim and reset_s <= o.arrival_s < reset_s + 20]
    cold = [o for o in after if o.cached_tokens < 0.3 * o.prompt_tokens]
    return {
        "requests_to_victim_20s": len(after),
        "cold_on_victim_20s": len(cold),
        "prefill_tokens_after_reset": sum(
            o.prompt_tokens - o.cached_tokens for o in outcomes if o.ok and o.arrival_s >= reset_s
        ),
    }


def tail_report(outcomes: Sequence[Outcome], timed: Sequence[TraceRequest]) -> dict[str, Any]:
    """Who is in the slowest 1% of TTFT: cold prompts (less than 30% cached), the busiest shopper's
    prompts, and how they spread over replicas; what moved the tail is read from this."""
    ok = sorted((o for o in outcomes if o.ok), key=lambda o: o.ttft_ms)
    if not ok:
        return {}
    top = ok[-max(1, len(ok) // 100) :]
    busiest = Counter(r.shopper_id for r in timed).most_common(2)
    hot = {s for s, _ in busiest}
    return {
        "p99_set": len(top),
        "cold": sum(o.cached_tokens < 0.3 * o.prompt_tokens for o in top),
        "hot_shopper": sum(o.shopper in hot for o in top),
        "replicas": dict(Counter(o.endpoint for o in top)),
        "retried": sum(o.attempts > 1 for o in top),
        "cold_share_all": sum(o.cached_tokens < 0.3 * o.prompt_tokens for o in ok) / len(ok),
    }


def server_tail_report(first_tokens: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the slowest 1% of first tokens waited for, as the replicas saw it: the queue (iterations
    already running or ahead of them) or the iteration that prefilled them (their own prompt and any
    other prefilled with it), against the same for every request."""
    ranked = sorted(first_tokens, key=lambda r: float(r["ttft_ms"]))
    if not ranked:
        return {}
    top = ranked[-max(1, len(ranked) // 100) :]

    def shape(records: Sequence[dict[str, Any]]) -> dict[str, float]:
        n = len(records)
        return {
            "ttft_ms": sum(float(r["ttft_ms"]) for r in records) / n,
            "queue_ms": sum(float(r["queue_ms"]) for r in records) / n,
            "cold_share": sum(r["cached_tokens"] < 0.3 * r["prompt_tokens"] for r in records) / n,
            "own_new_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in records) / n,
            "batch_prefill_tokens": sum(r["batch_prefill_tokens"] for r in records) / n,
            "batch_running": sum(r["batch_running"] for r in records) / n,
        }

    return {
        "p99_set": shape(top),
        "all": shape(ranked),
        "p99_replicas": dict(Counter(int(r["replica"]) for r in top)),
        "p99_requests": [dict(r) for r in top],
    }


async def _kill_later(fleet: SimFleet, client: LLMClient, replica: int, delay_s: float) -> float:
    """SIGKILL one replica after ``delay_s``; returns the wall seconds until the client ejected it."""
    await asyncio.sleep(delay_s)
    fleet.kill(replica)
    killed = time.perf_counter()
    victim = client.endpoints[replica]
    while victim.healthy:
        await asyncio.sleep(0.005)
    return time.perf_counter() - killed


WINDOW_S = 10.0


def windows(outcomes: Sequence[Outcome]) -> list[tuple[float, float, float]]:
    """(start, mean TTFT ms, cache-hit ratio) of the requests arriving in each 10 s simulated window."""
    ok = [o for o in outcomes if o.ok]
    end = max((o.arrival_s for o in ok), default=0.0)
    out: list[tuple[float, float, float]] = []
    t = 0.0
    while t <= end:
        sample = [o for o in ok if t <= o.arrival_s < t + WINDOW_S]
        if sample:
            ttft = statistics.fmean(o.ttft_ms for o in sample)
            hit = sum(o.cached_tokens for o in sample) / max(1, sum(o.prompt_tokens for o in sample))
            out.append((t, ttft, hit))
        t += WINDOW_S
    return out


def _kill_report(
    outcomes: Sequence[Outcome], kill_s: float, client: LLMClient, args: argparse.Namespace
) -> dict[str, Any]:
    victim = client.endpoints[args.kill_replica]
    retried = [o for o in outcomes if o.ok and o.attempts > 1]
    return {
        "kill_at_s": kill_s,
        "victim": victim.name,
        "victim_ejections": victim.ejections,
        "requests_retried": len(retried),
        "max_ttft_retried_ms": max((o.ttft_ms for o in retried), default=0.0),
    }


def recovery(kill: RunResult, reference: RunResult) -> dict[str, Any]:
    """Compare the kill run with the same run without a kill (same trace, same arrivals), window by
    window: recovered after the last window past the kill whose mean TTFT exceeds the reference's by
    more than 25% (and 50 ms) or whose cache-hit ratio is more than 5 points under it."""
    ref = {t: (ttft, hit) for t, ttft, hit in reference.extra["windows"]}
    kill_s = kill.extra["kill_at_s"]
    recovered_at = kill_s
    worst_ttft = worst_hit = 0.0
    for t, ttft, hit in kill.extra["windows"]:
        if t + WINDOW_S <= kill_s or t not in ref:
            continue
        ref_ttft, ref_hit = ref[t]
        worst_ttft, worst_hit = max(worst_ttft, ttft - ref_ttft), max(worst_hit, ref_hit - hit)
        if ttft > max(1.25 * ref_ttft, ref_ttft + 50) or hit < ref_hit - 0.05:
            recovered_at = t + WINDOW_S
    return {
        "recovery_s": recovered_at - kill_s,
        "worst_window_ttft_excess_ms": worst_ttft,
        "worst_window_hit_ratio_drop": worst_hit,
        "prefill_tokens_excess_vs_no_kill": kill.prefill_tokens - reference.prefill_tokens,
        "reference_windows": reference.extra["windows"],
    }


async def run_llama(
    policy: str, trace: Sequence[TraceRequest], oracle: OracleBound, args: argparse.Namespace
) -> RunResult:
    from devstack.llama import LlamaReplica, ensure_gemma_model, ensure_llama_binary

    binary, model = ensure_llama_binary(), ensure_gemma_model()
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                LlamaReplica(
                    binary=binary, model_path=model, parallel=2, threads=1, ctx_size=8192, cache_ram_mib=256
                )
            )
            for _ in range(args.llama_replicas)
        ]
        config = client_config(
            [r.url for r in replicas],
            policy,
            attempt_s=300,
            deadline_s=600,
            options=json.loads(args.prefix_aware_options),
        )
        async with LLMClient(config, seed=args.seed) as client:
            await client.wait_until_healthy(60)
            # closed loop: a shopper's next prompt waits for its previous answer, few in flight
            at_once = [replace(r, t=0.0) for r in trace]
            outcomes = await replay(
                client, at_once, 1.0, sequential_per_shopper=True, concurrency=args.llama_replicas
            )
            result = summarise(
                "llama", policy, 0.0, outcomes, client, oracle, None, time.perf_counter() - started
            )
    oracle_share = 1 - oracle.prefill_tokens_per_shopper / oracle.prompt_tokens
    result.extra["oracle_cached_share"] = oracle_share
    result.extra["cached_share_vs_oracle"] = result.cache_hit_ratio / oracle_share if oracle_share else 0.0
    return result


# ---- reporting -------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}, {platform.system()}"


def _md(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


SIM_HEADERS = (
    "util", "policy", "TTFT mean", "TTFT p50", "TTFT p99", "server TTFT mean", "e2e mean", "e2e p99", "req/s",
    "prefill tok", "vs oracle", "vs global bound", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def sim_row(r: RunResult) -> list[str]:
    server = f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-"
    return [
        f"{r.utilisation:.0%}",
        r.policy,
        f"{r.ttft_mean_ms:,.0f}",
        f"{r.ttft_p50_ms:,.0f}",
        f"{r.ttft_p99_ms:,.0f}",
        server,
        f"{r.e2e_mean_ms:,.0f}",
        f"{r.e2e_p99_ms:,.0f}",
        f"{r.throughput_rps:.2f}",
        f"{r.prefill_tokens:,}",
        f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper):.2f}x",
        f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens):.2f}x",
        f"{r.cache_hit_ratio:.0%}",
        f"{r.load_max_over_mean:.2f}",
        str(r.lost),
    ]


def sim_table(results: Sequence[RunResult]) -> str:
    return _md(SIM_HEADERS, [sim_row(r) for r in results])


LLAMA_HEADERS = (
    "policy", "requests", "lost", "TTFT mean ms", "TTFT p99 ms", "e2e mean ms", "cached/prompt", "vs oracle",
    "wall s",
)  # fmt: skip


def llama_table(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.policy,
            str(r.requests),
            str(r.lost),
            f"{r.ttft_mean_ms:,.0f}",
            f"{r.ttft_p99_ms:,.0f}",
            f"{r.e2e_mean_ms:,.0f}",
            f"{r.cache_hit_ratio:.0%}",
            f"{r.extra.get('cached_share_vs_oracle', 0):.2f}",
            f"{r.wall_s:.0f}",
        ]
        for r in results
    ]
    return _md(LLAMA_HEADERS, rows)


def targets(results: Sequence[RunResult], at: float) -> list[str]:
    by = {r.policy: r for r in results if abs(r.utilisation - at) < 1e-9}
    if not {"prefix_aware", "round_robin", "least_outstanding"} <= by.keys():
        return []
    pa, rr, lo = by["prefix_aware"], by["round_robin"], by["least_outstanding"]
    checks = [
        (
            "mean TTFT <= 0.4x round_robin",
            pa.ttft_mean_ms / rr.ttft_mean_ms,
            pa.ttft_mean_ms <= 0.4 * rr.ttft_mean_ms,
        ),
        (
            "server-side mean TTFT <= 0.4x round_robin",
            (pa.server_ttft_mean_ms or 0) / (rr.server_ttft_mean_ms or 1),
            (pa.server_ttft_mean_ms or 0) <= 0.4 * (rr.server_ttft_mean_ms or 0),
        ),
        (
            "prefill tokens <= 1.15x oracle",
            pa.prefill_tokens / pa.oracle_prefill_tokens_per_shopper,
            pa.prefill_tokens <= 1.15 * pa.oracle_prefill_tokens_per_shopper,
        ),
        ("p99 TTFT <= least_outstanding", pa.ttft_p99_ms / lo.ttft_p99_ms, pa.ttft_p99_ms <= lo.ttft_p99_ms),
        ("max/mean load <= 1.25", pa.load_max_over_mean, pa.load_max_over_mean <= 1.25),
    ]
    return [f"{'PASS' if ok else 'MISS'}  {name}: {value:.2f}" for name, value, ok in checks]


def plot(results: Sequence[RunResult], kill: RunResult | None, out: Path, tag: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results:
        _plot_sweep(plt, results, out / f"routing{tag}.png")
    if kill is not None and kill.extra.get("windows"):
        _plot_kill(plt, kill, out / f"routing{tag}_kill.png")


def _plot_sweep(plt: Any, results: Sequence[RunResult], path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for policy in POLICIES:
        rs = sorted((r for r in results if r.policy == policy), key=lambda r: r.utilisation)
        if not rs:
            continue
        u = [100 * r.utilisation for r in rs]
        axes[0].plot(u, [r.ttft_mean_ms for r in rs], marker="o", label=policy)
        axes[1].plot(u, [r.ttft_p99_ms for r in rs], marker="o", label=policy)
        axes[2].plot(u, [r.e2e_mean_ms / 1000 for r in rs], marker="o", label=policy)
        axes[3].plot(
            u, [r.prefill_tokens / r.oracle_prefill_tokens_per_shopper for r in rs], marker="o", label=policy
        )
    axes[0].set(
        title="mean TTFT", xlabel="utilisation of cache-oblivious capacity (%)", ylabel="ms (simulated)"
    )
    axes[1].set(title="p99 TTFT", xlabel="utilisation (%)", ylabel="ms (simulated)")
    axes[2].set(title="mean end-to-end latency", xlabel="utilisation (%)", ylabel="s (simulated)")
    axes[3].set(title="prefill tokens computed / oracle", xlabel="utilisation (%)", ylabel="x oracle")
    axes[3].axhline(1.15, color="grey", linestyle=":", linewidth=1)
    for ax in axes[:3]:
        ax.set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("8 simulated H100 replicas (qwen2.5-32b cost model), shopper-session trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kill(plt: Any, kill: RunResult, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    # x: the centre of each arrival window, relative to the kill; requests in flight at the kill arrived
    # in the windows just before it (their retries show there).
    xs = [t + WINDOW_S / 2 - kill.extra["kill_at_s"] for t, _, _ in kill.extra["windows"]]
    ax.plot(xs, [m for _, m, _ in kill.extra["windows"]], marker=".", label="mean TTFT (ms)")
    ref = kill.extra.get("reference_windows") or []
    ax.plot(
        [t + WINDOW_S / 2 - kill.extra["kill_at_s"] for t, _, _ in ref], [m for _, m, _ in ref],
        color="grey", linestyle=":", label="same run, no kill",
    )  # fmt: skip
    ax.axvline(0, color="red", linewidth=1)
    ax.set(
        title="prefix_aware, 8 replicas, one SIGKILLed at t=0",
        xlabel="arrival (10 s window centre), s from the kill (simulated)",
        ylabel="mean TTFT per 10 s window (ms)",
    )
    hits = ax.twinx()
    hits.plot(
        xs, [100 * h for _, _, h in kill.extra["windows"]], color="green", marker=".", label="cache hit %"
    )
    hits.set(ylabel="cache hit (%)", ylim=(0, 100))
    ax.legend(loc="lower left")
    hits.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(name: str, payload: Any) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(payload, indent=1, default=str) + "\n")


# ---- stress scenarios -------------------------------------------------------------------------------
SCENARIO_POLICIES = (
    "round_robin", "least_outstanding", "session_affinity", "prefix_aware", "prefix_aware_precise",
    "prefix_aware_noguard", "prefix_aware_spread",
)  # fmt: skip
RESTART_POLICIES = ("prefix_aware", "prefix_aware_precise")
"""The reset scenario compares the two ways of learning about it; the baselines learn nothing."""


@dataclass(frozen=True)
class Scenario:
    """One load shape: the trace, the arrival process, the replicas' cache size, an optional reset."""

    name: str
    description: str
    trace: TraceConfig
    bursty: bool = False
    cache_blocks: int = 8192
    reset_at_fraction: float | None = None


def scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    """The stress shapes, every parameter from the command line."""
    base = TraceConfig(shoppers=args.shoppers, seed=args.seed)
    skew = replace(
        base,
        hot_count=args.skew_hot_shoppers,
        hot_factor=args.skew_hot_factor,
        hot_span_s=base.session_spread_s,
    )
    long = replace(
        base,
        hot_fraction=args.long_hot_fraction,
        hot_factor=args.long_hot_factor,
        max_log_tokens=args.long_max_log_tokens,
        hot_span_s=base.session_spread_s,
    )
    return {
        "base": Scenario("base", "the sweep's trace, Poisson arrivals", base),
        "skew": Scenario(
            "skew",
            f"{args.skew_hot_shoppers} hot shoppers with {args.skew_hot_factor:g}x the bursts, Poisson",
            skew,
        ),
        "burst": Scenario(
            "burst",
            f"skew + on/off arrivals ({args.burst_peak:g}x the mean rate for {args.burst_on_fraction:.0%} of "
            f"every {args.burst_period_s:g} s)",
            skew,
            bursty=True,
        ),
        "long": Scenario(
            "long",
            f"{args.long_hot_fraction:.0%} long-session shoppers ({args.long_hot_factor:g}x the bursts), "
            f"logs trimmed at {args.long_max_log_tokens} tokens",
            long,
        ),
        "evict": Scenario(
            "evict",
            f"skew with {args.evict_cache_blocks} KV blocks per replica (eviction pressure)",
            skew,
            cache_blocks=args.evict_cache_blocks,
        ),
        "restart": Scenario(
            "restart",
            f"base, replica {args.kill_replica}'s cache emptied at half the prompts",
            base,
            reset_at_fraction=0.5,
        ),
    }


async def run_scenarios(args: argparse.Namespace) -> list[RunResult]:
    chosen = [scenarios(args)[name] for name in args.scenarios.split(",")]
    policies = [p for p in args.scenario_policies.split(",") if p]
    results: list[RunResult] = []
    traces: dict[TraceConfig, tuple[list[TraceRequest], OracleBound, float]] = {}
    for sc in chosen:
        if sc.trace not in traces:
            trace = generate_trace(sc.trace)
            traces[sc.trace] = (
                trace,
                oracle_prefill(trace, BLOCK),
                await measure_capacity(trace, engine_options=engine_options(args)) * args.replicas,
            )
        trace, oracle, capacity = traces[sc.trace]
        rate = args.scenario_utilisation * capacity
        top = Counter(r.shopper_id for r in trace).most_common(args.skew_hot_shoppers)
        print(
            f"\n## {sc.name}: {sc.description}\n{len(trace)} prompts from {sc.trace.shoppers} shoppers "
            f"(busiest {len(top)}: {sum(n for _, n in top) / len(trace):.0%} of the prompts), "
            f"{oracle.prompt_tokens:,} prompt tokens, oracle prefill {oracle.prefill_tokens_per_shopper:,}; "
            f"{args.scenario_utilisation:.0%} of {capacity:.2f} req/s; {sc.cache_blocks} KV blocks/replica",
            flush=True,
        )
        fleet_args = ["--cache-capacity-blocks", str(sc.cache_blocks), "--kv-event-buffer-max-size", "65536"]
        options = {**json.loads(args.prefix_aware_options), "max_blocks_per_replica": sc.cache_blocks}
        for repeat in range(args.repeats):
            # Each repeat draws new arrival times for the same prompts; every policy gets the same ones.
            arrival_seed = args.seed + repeat
            if sc.bursty:
                timed = with_onoff_arrivals(
                    trace,
                    rate,
                    peak_factor=args.burst_peak,
                    on_fraction=args.burst_on_fraction,
                    period_s=args.burst_period_s,
                    seed=arrival_seed,
                )
            else:
                timed = with_poisson_arrivals(trace, rate, seed=arrival_seed)
            for policy in [p for p in policies if sc.reset_at_fraction is None or p in RESTART_POLICIES]:
                result, _ = await run_sim(
                    policy,
                    args.scenario_utilisation,
                    trace,
                    capacity,
                    oracle,
                    args,
                    timed=timed,
                    fleet_args=fleet_args,
                    options=options,
                    reset_at_fraction=sc.reset_at_fraction,
                    setup=sc.name,
                )
                result.policy = policy
                result.extra["repeat"], result.extra["arrival_seed"] = repeat, arrival_seed
                results.append(result)
                print(
                    scenario_table([result]).splitlines()[-1],
                    f"(repeat {repeat}, {result.wall_s:.0f} s wall, load {result.extra['loadavg_1m']})",
                    flush=True,
                )
                print(
                    "   tail:",
                    json.dumps(result.extra.get("tail")),
                    json.dumps(result.extra.get("policy_stats")),
                )
                server_tail = result.extra.get("server_tail") or {}
                print("   server tail:", json.dumps({k: server_tail.get(k) for k in ("p99_set", "all")}))
        for line in scenario_targets(aggregate([r for r in results if r.setup == sc.name])):
            print("  ", line)
    return results


SCENARIO_HEADERS = (
    "scenario", "policy", "server TTFT mean", "server p50", "server p99", "client TTFT mean", "client p99",
    "e2e p99", "prefill vs oracle", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def scenario_table(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.setup,
            r.policy,
            f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-",
            f"{r.server_ttft_p50_ms:,.0f}" if r.server_ttft_p50_ms is not None else "-",
            f"{r.server_ttft_p99_ms:,.0f}" if r.server_ttft_p99_ms is not None else "-",
            f"{r.ttft_mean_ms:,.0f}",
            f"{r.ttft_p99_ms:,.0f}",
            f"{r.e2e_p99_ms:,.0f}",
            f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper):.2f}x",
            f"{r.cache_hit_ratio:.0%}",
            f"{r.load_max_over_mean:.2f}",
            str(r.lost),
        ]
        for r in results
    ]
    return _md(SCENARIO_HEADERS, rows)


BOOTSTRAP_SAMPLES = 1000


@dataclass
class Aggregate:
    """One scenario x policy over its repeats. ``ttfts`` pools every repeat's server-side TTFTs (each
    repeat's requests are a sample of the same load shape), so its p99 is the 10th worst of 1,000
    rather than the 5th of 500; ``p99_ci`` is its 95% bootstrap interval (requests resampled within
    each repeat); ``p99_median`` the median of the repeats' own p99s."""

    setup: str
    policy: str
    repeats: int
    requests: int
    lost: int
    ttfts: list[float]
    p50: float
    p99: float
    p99_ci: tuple[float, float]
    p99_median: float
    p99_per_repeat: list[float]
    mean: float
    client_p99_median: float
    prefill_vs_oracle: float
    cache_hit: float
    load_max_over_mean: float
    """The worst repeat's."""
    results: list[RunResult] = field(repr=False, default_factory=list)


def _bootstrap_p99(samples: Sequence[Sequence[float]], rng: random.Random) -> list[float]:
    """Bootstrap distribution of the pooled p99: each repeat's TTFTs resampled with replacement."""
    out = []
    for _ in range(BOOTSTRAP_SAMPLES):
        pooled = sorted(v for s in samples for v in rng.choices(s, k=len(s)))
        out.append(_pct(pooled, 99))
    return out


def aggregate(results: Sequence[RunResult]) -> list[Aggregate]:
    """Pool each (scenario, policy)'s repeats; runs without per-request server TTFTs fall back to the
    client-side ones."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.setup, r.policy), []).append(r)
    out = []
    for (setup, policy), rs in groups.items():
        per_repeat = [list(r.extra.get("server_ttfts_ms") or []) for r in rs]
        pooled = sorted(v for s in per_repeat for v in s)
        boot = sorted(_bootstrap_p99([s for s in per_repeat if s], random.Random(7))) if pooled else [0.0]
        repeat_p99 = [r.server_ttft_p99_ms if r.server_ttft_p99_ms is not None else r.ttft_p99_ms for r in rs]
        prompt = sum(r.prompt_tokens for r in rs)
        out.append(
            Aggregate(
                setup=setup,
                policy=policy,
                repeats=len(rs),
                requests=sum(r.requests for r in rs),
                lost=sum(r.lost for r in rs),
                ttfts=pooled,
                p50=_pct(pooled, 50),
                p99=_pct(pooled, 99) if pooled else statistics.median(repeat_p99),
                p99_ci=(_pct(boot, 2.5), _pct(boot, 97.5)),
                p99_median=statistics.median(repeat_p99),
                p99_per_repeat=repeat_p99,
                mean=statistics.fmean(pooled) if pooled else 0.0,
                client_p99_median=statistics.median(r.ttft_p99_ms for r in rs),
                prefill_vs_oracle=sum(r.prefill_tokens for r in rs)
                / max(1, sum(r.oracle_prefill_tokens_per_shopper for r in rs)),
                cache_hit=sum(r.prompt_tokens * r.cache_hit_ratio for r in rs) / prompt if prompt else 0.0,
                load_max_over_mean=max(r.load_max_over_mean for r in rs),
                results=list(rs),
            )
        )
    return out


def _ratio_ci(a: Aggregate, best: Aggregate) -> tuple[float, float] | None:
    """95% bootstrap interval of ``a``'s pooled p99 over ``best``'s (the two resampled independently);
    None for runs stored without per-request TTFTs."""
    num_samples = [s for s in _per_repeat(a) if s]
    den_samples = [s for s in _per_repeat(best) if s]
    if not num_samples or not den_samples:
        return None
    rng = random.Random(11)
    num, den = _bootstrap_p99(num_samples, rng), _bootstrap_p99(den_samples, rng)
    ratios = sorted(x / y for x, y in zip(num, den, strict=True) if y > 0)
    return _pct(ratios, 2.5), _pct(ratios, 97.5)


def _per_repeat(a: Aggregate) -> list[list[float]]:
    return [list(r.extra.get("server_ttfts_ms") or []) for r in a.results]


AGGREGATE_HEADERS = (
    "scenario", "policy", "runs", "server TTFT mean", "server p50", "server p99 (pooled)", "95% CI",
    "p99 per run", "client p99 (median)", "prefill ÷ oracle", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def aggregate_table(aggregates: Sequence[Aggregate]) -> str:
    rows = [
        [
            a.setup,
            a.policy,
            str(a.repeats),
            f"{a.mean:,.0f}",
            f"{a.p50:,.0f}",
            f"{a.p99:,.0f}",
            f"{a.p99_ci[0]:,.0f}-{a.p99_ci[1]:,.0f}",
            " / ".join(f"{v:,.0f}" for v in a.p99_per_repeat),
            f"{a.client_p99_median:,.0f}",
            f"{a.prefill_vs_oracle:.2f}x",
            f"{a.cache_hit:.0%}",
            f"{a.load_max_over_mean:.2f}",
            str(a.lost),
        ]
        for a in aggregates
    ]
    return _md(AGGREGATE_HEADERS, rows)


def scenario_targets(aggregates: Sequence[Aggregate]) -> list[str]:
    """The issue's targets for each prefix_aware mode in one scenario, on the repeats pooled: p99 no
    worse than the better baseline (a point estimate; the bootstrap interval of the ratio says how much
    of the margin is noise), prefill <= 1.15x the oracle, the worst repeat's max/mean load <= 1.25."""
    by = {a.policy: a for a in aggregates}
    if not {"round_robin", "least_outstanding"} <= by.keys():
        return []
    best = min(by["round_robin"], by["least_outstanding"], key=lambda a: a.p99)
    lines = []
    for mode in [p for p in by if p.startswith("prefix_aware")]:
        a = by[mode]
        ci = _ratio_ci(a, best)
        spread = f"95% CI {ci[0]:.2f}-{ci[1]:.2f}; " if ci else ""
        for name, value, ok, note in (
            (
                f"server p99 / {best.policy}'s",
                a.p99 / best.p99,
                a.p99 <= best.p99,
                f" ({spread}median of runs {a.p99_median / best.p99_median:.2f})",
            ),
            ("prefill / oracle <= 1.15", a.prefill_vs_oracle, a.prefill_vs_oracle <= 1.15, ""),
            ("max/mean load <= 1.25", a.load_max_over_mean, a.load_max_over_mean <= 1.25, ""),
        ):
            lines.append(f"{'PASS' if ok else 'MISS'}  {a.setup} {mode}: {name}: {value:.2f}{note}")
    return lines


# ---- main ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small trace, one utilisation: a smoke run")
    p.add_argument("--setups", default="sim,kill,llama", help="comma list of sim, kill, llama, scenarios")
    s = p.add_argument_group("stress scenarios (--setups scenarios)")
    s.add_argument("--scenarios", default="base,skew,burst,long,evict,restart")
    s.add_argument("--scenario-policies", default=",".join(SCENARIO_POLICIES))
    s.add_argument("--scenario-utilisation", type=float, default=0.7)
    s.add_argument(
        "--repeats", type=int, default=1, help="replays per scenario and policy, each with new arrival times"
    )
    s.add_argument("--skew-hot-shoppers", type=int, default=1, help="shoppers making a large share")
    s.add_argument("--skew-hot-factor", type=float, default=35.0, help="their bursts, x an ordinary one")
    s.add_argument("--burst-peak", type=float, default=3.0, help="on-period rate, x the mean")
    s.add_argument("--burst-on-fraction", type=float, default=0.25)
    s.add_argument("--burst-period-s", type=float, default=40.0, help="simulated seconds")
    s.add_argument("--long-hot-fraction", type=float, default=0.1)
    s.add_argument("--long-hot-factor", type=float, default=8.0)
    s.add_argument("--long-max-log-tokens", type=int, default=2400)
    s.add_argument("--evict-cache-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--utilisations", default="0.5,0.7,0.9")
    p.add_argument("--shoppers", type=int, default=200)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.5, help="wall seconds per simulated second")
    p.add_argument("--coalesce-s", type=float, default=0.25, help="simulator SSE coalescing (wall s)")
    p.add_argument("--kill-utilisation", type=float, default=0.7)
    p.add_argument("--kill-replica", type=int, default=3)
    p.add_argument("--llama-replicas", type=int, default=3)
    p.add_argument("--llama-shoppers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix-aware-options", default="{}", help="JSON of PrefixAwareSettings")
    p.add_argument(
        "--engine-options",
        default="{}",
        help="JSON of SimulatorConfig settings for every replica of every policy, e.g. "
        '\'{"enable_chunked_prefill": true, "max_num_tokens": 2048}\' (capacity is measured with them)',
    )
    p.add_argument("--tag", default="", help="suffix of the result files (routing<TAG>.json ...)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNGs from the JSON results")
    p.add_argument(
        "--combine",
        default="",
        help="comma list of routing_scenarios*.json files: pool their runs (e.g. scenarios run in separate "
        "invocations), print the tables and targets, write routing_scenarios<TAG>.json; runs nothing",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.shoppers, args.utilisations, args.llama_shoppers = 40, "0.7", 4
    return args


def replot(tag: str) -> None:
    """Redraw the figures from the JSON of an earlier run."""
    fields = set(RunResult.__dataclass_fields__)

    def load(name: str) -> Any:
        path = RESULTS / name
        return json.loads(path.read_text()) if path.exists() else None

    sweep = load(f"routing{tag}.json")
    kill = load(f"routing{tag}_kill.json")
    results = [
        RunResult(**{k: v for k, v in r.items() if k in fields}) for r in (sweep or {}).get("results", [])
    ]
    kill_result = RunResult(**{k: v for k, v in kill["result"].items() if k in fields}) if kill else None
    plot(results, kill_result, RESULTS, tag)


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args.tag)
        return
    setups = set(args.setups.split(","))
    policies = args.policies.split(",")
    print(f"machine: {machine()}")
    if args.combine:
        report_scenarios(load_results(args.combine.split(",")), args)
        return
    if "scenarios" in setups:
        report_scenarios(await run_scenarios(args), args)
    await _other_setups(args, setups, policies)


def load_results(paths: Sequence[str]) -> list[RunResult]:
    """The runs stored in ``routing_scenarios*.json`` files."""
    fields = set(RunResult.__dataclass_fields__)
    return [
        RunResult(**{k: v for k, v in r.items() if k in fields})
        for name in paths
        for r in json.loads(Path(name).read_text())["results"]
    ]


def report_scenarios(results: Sequence[RunResult], args: argparse.Namespace) -> None:
    """Print the per-run and pooled tables and the targets; write ``routing_scenarios<TAG>.json``."""
    print("\n" + scenario_table(results))
    aggregates = aggregate(results)
    print("\n" + aggregate_table(aggregates))
    verdicts: dict[str, list[str]] = {}
    for name in dict.fromkeys(r.setup for r in results):
        verdicts[name] = scenario_targets([a for a in aggregates if a.setup == name])
        for line in verdicts[name]:
            print("  ", line)
    _write(
        f"routing_scenarios{args.tag}.json",
        {
            "machine": machine(),
            "args": vars(args),
            "results": [asdict(r) for r in results],
            "aggregates": [
                {k: v for k, v in asdict(a).items() if k not in ("ttfts", "results")} for a in aggregates
            ],
            "targets": verdicts,
        },
    )


async def _other_setups(args: argparse.Namespace, setups: set[str], policies: list[str]) -> None:
    sim_results: list[RunResult] = []
    kill_result: RunResult | None = None
    if setups & {"sim", "kill"}:
        trace = generate_trace(TraceConfig(shoppers=args.shoppers, seed=args.seed))
        oracle = oracle_prefill(trace, BLOCK)
        capacity = await measure_capacity(trace, engine_options=engine_options(args)) * args.replicas
        mean_tokens = oracle.prompt_tokens / len(trace)
        print(
            f"trace: {len(trace)} prompts from {args.shoppers} shoppers, {oracle.prompt_tokens:,} prompt "
            f"tokens (mean {mean_tokens:,.0f}); oracle prefill {oracle.prefill_tokens_per_shopper:,} "
            f"(global bound {oracle.prefill_tokens_global:,}); cache-oblivious capacity {capacity:.2f} "
            f"req/s for {args.replicas} replicas; time scale {args.time_scale}"
        )
        if "sim" in setups:
            for utilisation in (float(u) for u in args.utilisations.split(",")):
                for policy in policies:
                    result, _ = await run_sim(policy, utilisation, trace, capacity, oracle, args)
                    sim_results.append(result)
                    print(sim_table([result]).splitlines()[-1], f"({result.wall_s:.0f} s wall)", flush=True)
            print("\n" + sim_table(sim_results))
            for u in sorted({r.utilisation for r in sim_results}):
                rs = [r for r in sim_results if r.utilisation == u]
                # Little's law: requests running per replica = throughput per replica x e2e latency.
                batch = max(
                    1,
                    round(
                        statistics.fmean(r.throughput_rps * r.e2e_mean_ms / 1000 for r in rs) / args.replicas
                    ),
                )
                floor_oracle, floor_head = ttft_floor_ms(trace, batch)
                for r in rs:
                    r.extra["ttft_floor_oracle_ms"], r.extra["ttft_floor_head_only_ms"] = (
                        floor_oracle,
                        floor_head,
                    )
                print(
                    f"  {u:.0%}: TTFT floor (no queueing, batch {batch}): {floor_oracle:.0f} ms with oracle "
                    f"caching, {floor_head:.0f} ms with head-only caching "
                    f"(ratio {floor_oracle / floor_head:.2f})"
                )
                for line in targets(sim_results, u):
                    print(f"  {u:.0%}: {line}")
            _write(
                f"routing{args.tag}.json",
                {
                    "machine": machine(),
                    "args": vars(args),
                    "capacity_rps": capacity,
                    "oracle": asdict(oracle),
                    "results": [asdict(r) for r in sim_results],
                },
            )
        if "kill" in setups:
            reference = next(
                (
                    r
                    for r in sim_results
                    if r.policy == "prefix_aware" and r.utilisation == args.kill_utilisation
                ),
                None,
            )
            if reference is None:  # the same run without a kill, to compare with window by window
                reference, _ = await run_sim(
                    "prefix_aware", args.kill_utilisation, trace, capacity, oracle, args
                )
            kill_result, _ = await run_sim(
                "prefix_aware", args.kill_utilisation, trace, capacity, oracle, args, kill_at_fraction=0.5
            )
            kill_result.extra.update(recovery(kill_result, reference))
            print("\nno kill (reference):\n" + sim_table([reference]))
            extra = {k: v for k, v in kill_result.extra.items() if "windows" not in k}
            print("\nkill run (prefix_aware, one replica SIGKILLed halfway):")
            print(sim_table([kill_result]))
            print(json.dumps(extra, indent=1, default=str))
            _write(
                f"routing{args.tag}_kill.json",
                {
                    "machine": machine(),
                    "args": vars(args),
                    "result": asdict(kill_result),
                    "reference": asdict(reference),
                },
            )
        plot(sim_results, kill_result, RESULTS, args.tag)
    if "llama" in setups:
        llama_trace = generate_trace(
            TraceConfig(
                shoppers=args.llama_shoppers,
                hot_fraction=0.0,
                bursts=(2, 3),
                burst_events=(2, 4),
                backlog_events=(4, 7),
                max_log_tokens=700,
                max_tokens=(8, 12),
                seed=args.seed,
            )
        )
        oracle = oracle_prefill(llama_trace, BLOCK)
        print(
            f"\nllama: {len(llama_trace)} prompts from {args.llama_shoppers} shoppers, mean "
            f"{oracle.prompt_tokens / len(llama_trace):,.0f} tokens (project tokenizer); oracle cached share "
            f"{1 - oracle.prefill_tokens_per_shopper / oracle.prompt_tokens:.0%}"
        )
        llama_results = []
        for policy in policies:
            result = await run_llama(policy, llama_trace, oracle, args)
            llama_results.append(result)
            print(llama_table([result]).splitlines()[-1], flush=True)
        print("\n" + llama_table(llama_results))
        _write(
            f"routing{args.tag}_llama.json",
            {"machine": machine(), "args": vars(args), "results": [asdict(r) for r in llama_results]},
        )


if __name__ == "__main__":
    asyncio.run(main())
