"""Real-time benchmark: the service's overhead over the model's time at a nominal rate, and deadlines
kept at twice that rate. Open-loop load (Poisson arrivals at a fixed rate, bounded in count and time,
loopback only): a request is sent at its scheduled time whether or not earlier ones were answered, and
its latency counts from that scheduled time, so a stalled generator or service cannot hide latency.

Set-up: a throwaway stack (Redis, simulator replicas); ``shopper realtime serve`` as a separate
process on the first ``--replicas`` replicas; shopper and product signals written to Redis by the same
writers the pipelines use; 10 candidates per request. The replicas' speed is tuned (``/admin/config``
slowdown) until an unloaded ranking call takes ``--llm-ms`` (150 ms).

Phases:
  nominal   ``--rate`` req/s (200) for ``--seconds``: overhead = client-observed latency minus the
            service's time waiting for the model (``llm_ms`` in the answer); p99 and errors
  overload  2 x ``--rate`` for ``--overload-seconds``: every answer within its deadline (300 ms),
            degraded where the pool could not answer in time, or refused at once (429 ``overloaded``,
            deadline-aware admission) where the service could not answer in time at all

Each request carries ``X-Request-Start`` with its scheduled send time, so the service counts the
deadline from there (``--no-request-start``: from arrival, as a caller without it). CPU per request
is read two ways: the service's own counter on ``/metrics`` (``realtime_process_cpu_seconds_total``
over the requests it counted) and ``/proc`` for every process of the run.

Equal work (``--arm``, repeated): CPU per request where every request is answered by the model, for
several services on one stack (another checkout's, or this one's with other settings), in rounds that
alternate between them (A B, then B A, ...), closed loop of ``--concurrency`` callers with a loose
deadline. The load average moves CPU per request by itself, so only the ratio within a round compares;
``--profile-dir`` adds one py-spy round per service (on-CPU samples by package).

Prints tables and the machine; writes bench/results/realtime.json (``--arm``: realtime_cpu.json;
``--quick``: realtime_quick.json or realtime_cpu_quick.json, so a smoke run never overwrites them).

Usage:
  .venv/bin/python -m bench.realtime            # the documented run (about 2 minutes)
  .venv/bin/python -m bench.realtime --quick    # 10 s phases (an explicit --seconds/--overload-seconds wins)
  .venv/bin/python -m bench.realtime --service-root /tmp/old --out realtime_before  # an older service:
      # /tmp/old = this checkout with another commit's realtime/ (docs/realtime.md shows the commands)
  .venv/bin/python -m bench.realtime --arm before=/tmp/old --arm after=. --rounds 6  # CPU at equal work
  .venv/bin/python -m bench.realtime --arm asyncio=.,REALTIME_EVENT_LOOP=asyncio --arm uvloop=.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from batch.signals import ProductSignalWriter
from bench.common import (
    REPO,
    machine,
    percentile,
    print_table,
    process_cpu_seconds,
    results_dir,
    temporary_stack,
)
from devstack.served_process import ServedProcess, start_realtime_service
from devstack.stack import StackState, sink_settings
from devstack.synthetic import build_catalog
from prompt_assembly.records import ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding
from sinks.redis import RedisSignalSink

RESULTS = results_dir()
QUERIES = ["witch costume", "halloween decor", "kids costume", "party", "", "spooky lights", "candy"]
INTERESTS = [
    ["kids witch costumes", "face paint"],
    ["gothic costumes", "fake blood"],
    ["yard decorations", "string lights"],
    ["pet costumes"],
    ["bulk candy", "party supplies"],
]


def _cpu_per_request(pids: dict[str, list[int]], before: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds of CPU per request of each group of processes since ``before``."""
    return {
        name: round(1000 * (sum(process_cpu_seconds(p) for p in group) - before[name]) / max(requests, 1), 2)
        for name, group in pids.items()
    }


async def _service_counters(url: str) -> tuple[float, float] | None:
    """(CPU seconds, requests handled) from the service's own ``/metrics``: its process CPU counter
    and its answered plus refused requests; None from a service without the counter."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    cpu, handled = None, 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "realtime_process_cpu_seconds_total":
            cpu = float(value)
        elif name.startswith(("realtime_requests_total{", "realtime_rejected_total{")):
            handled += float(value)
    return None if cpu is None else (cpu, handled)


CONNECTION_COUNTERS = {
    "signal_errors": "realtime_signal_errors_total",
    "cut_kept": 'realtime_llm_cut_calls_total{outcome="kept"}',
    "cut_closed": 'realtime_llm_cut_calls_total{outcome="closed"}',
    "cut_closed_at_once": 'realtime_llm_cut_calls_total{outcome="closed_at_once"}',
}
"""What costs or saves a connection, from the service's ``/metrics``: a Redis read that failed or timed
out (its connection closes; the next read opens a new one), and a model call cut at its deadline that
was read to its end within the grace (connection kept) or closed (the next call opens a new one)."""


async def _connection_counters(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    found: dict[str, float] = {}  # a counter the service does not export (an older one's) stays absent
    for line in text.splitlines():
        for key, prefix in CONNECTION_COUNTERS.items():
            if line.startswith(prefix):
                found[key] = found.get(key, 0.0) + float(line.rpartition(" ")[2])
    return found


def _service_cpu_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(1000 * (after[0] - before[0]) / (after[1] - before[1]), 3)


@dataclass
class Sample:
    scheduled: float
    sent_lag_ms: float
    latency_ms: float
    status: int
    degraded_reason: str | None
    llm_ms: float | None
    deadline_ms: int
    elapsed_ms: float | None = None
    """The service's own arrival-to-answer time (from the answer)."""
    refused: bool = False
    """Refused at once by deadline-aware admission (429 ``overloaded``)."""


async def _write_signals(stack: StackState, prefix: str, shoppers: int) -> list[str]:
    import redis.asyncio as aioredis

    sinks = sink_settings(stack, redis_key_prefix=prefix)
    client = aioredis.Redis.from_url(stack.redis_url)
    products = [p for ps in build_catalog(random.Random(7)).values() for p in ps]
    rows = []
    for p in products:
        understanding = {
            "segments": [f"fans of {p.category.split(' > ')[1].lower()}"],
            "occasions": ["halloween"],
            "style": "fun",
            "price_tier": "mid",
            "summary": f"{p.title} by {p.brand}.",
        }
        body = {"product_id": p.product_id, "title": p.title, "model": "m", "parts": 1, "usage": {}}
        rows.append(
            {"custom_id": p.product_id, "response": {"body": {**body, "understanding": understanding}}}
        )
    await ProductSignalWriter(client, prefix, 3600).write("bench", rows)
    sink = RedisSignalSink(sinks, client=client)
    insights = []
    for i in range(shoppers):
        interests = INTERESTS[i % len(INTERESTS)]
        shopper = ShopperUnderstanding(
            interests=interests, occasion="halloween", style="fun", price_sensitivity="medium",
            summary=f"Shopper interested in {', '.join(interests)}.",
        )  # fmt: skip
        insight = ShopperInsight(
            request_id=f"b{i}:1", shopper_id=f"b{i}", seq=1, reason="add_to_cart",
            understanding=shopper, text="t", model="m", replica="r", usage=Usage(), event_count=3,
            last_event_ts=time.time(), ttft_ms=1, latency_ms=1, attempts=1, produced_at=time.time(),
        )  # fmt: skip
        insights.append(insight)
    await sink.write(insights)
    await client.aclose()
    return [p.product_id for p in products]


def _body(rng: random.Random, products: list[str], shoppers: int, deadline_ms: int) -> bytes:
    return orjson.dumps(
        {
            "shopper_id": f"b{rng.randrange(shoppers)}",
            "query": rng.choice(QUERIES),
            "candidates": [
                {"product_id": p, "score": round(rng.random(), 3)} for p in rng.sample(products, 10)
            ],
            "deadline_ms": deadline_ms,
        }
    )


@contextlib.asynccontextmanager
async def _generator_gc_off() -> AsyncIterator[None]:
    """The generator's cyclic collector off for one phase (bounded: at most ``rate * seconds * 1.5``
    requests), then one collection. With it on, a collection over the phase's samples and tasks held
    the generator's loop for up to 80 ms at 400 req/s (the maximum of its send lag: 80 ms, 13 ms with
    it off), and the answers that arrived meanwhile were read late and counted late."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    deadline_ms: int,
    products: list[str],
    shoppers: int,
    seed: int,
    request_start: bool = True,
) -> list[Sample]:
    """Poisson arrivals at ``rate`` for ``seconds``; at most ``rate * seconds * 1.5`` requests. With
    ``request_start`` each request says its scheduled send time (``X-Request-Start``)."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    epoch = time.time() - loop.time()
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=deadline_ms / 1000 + 2.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, _generator_gc_off():

        async def one(scheduled: float, body: bytes) -> None:
            lag = (loop.time() - scheduled) * 1000
            status, reason, llm_ms, elapsed, refused = 0, None, None, None, False
            headers = {"Content-Type": "application/json"}
            if request_start:
                headers["X-Request-Start"] = f"t={epoch + scheduled:.6f}"
            try:
                async with session.post(url + "/v1/match", data=body, headers=headers) as r:
                    raw = await r.read()
                    status = r.status
                if status == 200:
                    answer = orjson.loads(raw)
                    reason, llm_ms, elapsed = (
                        answer["degraded_reason"],
                        answer["llm_ms"],
                        answer["elapsed_ms"],
                    )
                elif status == 429:
                    refused = orjson.loads(raw)["error"]["type"] == "overloaded"
            except (aiohttp.ClientError, TimeoutError):
                status = -1
            latency = (loop.time() - scheduled) * 1000
            samples.append(
                Sample(scheduled, lag, latency, status, reason, llm_ms, deadline_ms, elapsed, refused)
            )

        # Only the requests still in flight are held and awaited at the end. A gather over every task
        # of the phase, most long done, held the generator's loop as the phase ended: the last 14
        # answers of a 5,849-request phase were read 70-95 ms late and counted late.
        in_flight: set[asyncio.Task[None]] = set()
        start = loop.time() + 0.2
        at = start
        limit = int(rate * seconds * 1.5)
        sent = 0
        while at < start + seconds and sent < limit:
            body = _body(rng, products, shoppers, deadline_ms)
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(at, body))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            sent += 1
            at += rng.expovariate(rate)
        while in_flight:
            await asyncio.wait(set(in_flight))
    return samples


def summarise(name: str, rate: float, samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    refused = [s for s in samples if s.refused]
    answered_by_llm = [s for s in ok if s.degraded_reason is None and s.llm_ms is not None]
    overhead = [s.latency_ms - (s.llm_ms or 0.0) for s in ok]
    llm_ms = [s.llm_ms or 0.0 for s in answered_by_llm]
    llm_overhead = [s.latency_ms - (s.llm_ms or 0.0) for s in answered_by_llm]
    # The same, inside the service's handler (its ``elapsed_ms``): what is left of the overhead is
    # outside it, in HTTP parsing and writing on both ends, loopback, and the generator's own loop.
    handler_overhead = [(s.elapsed_ms or 0.0) - (s.llm_ms or 0.0) for s in ok]
    span = max(s.scheduled for s in samples) - min(s.scheduled for s in samples)
    return {
        "phase": name,
        "target_rps": rate,
        "offered_rps": round(len(samples) / max(span, 1e-9), 1),
        "requests": len(samples),
        "errors": len(samples) - len(ok) - len(refused),
        "refused": len(refused),
        "refused_late": sum(1 for s in refused if s.latency_ms > s.deadline_ms),
        "refusal_p99_ms": round(percentile([s.latency_ms for s in refused], 0.99), 2) if refused else None,
        "degraded": dict(Counter(s.degraded_reason for s in ok if s.degraded_reason)),
        "degraded_pct": round(100 * (len(ok) - len(answered_by_llm)) / max(len(ok), 1), 2),
        "late": sum(1 for s in ok if s.latency_ms > s.deadline_ms),
        "late_other": sum(1 for s in samples if s.status not in (200, 429) and s.latency_ms > s.deadline_ms),
        "late_in_service": sum(1 for s in samples if (s.elapsed_ms or 0.0) > s.deadline_ms),
        "service_p99_ms": round(percentile([s.elapsed_ms or 0.0 for s in ok], 0.99), 2),
        "latency_p50_ms": round(percentile([s.latency_ms for s in samples], 0.5), 2),
        "latency_p99_ms": round(percentile([s.latency_ms for s in samples], 0.99), 2),
        "latency_max_ms": round(max(s.latency_ms for s in samples), 2),
        "llm_p50_ms": round(statistics.median(llm_ms), 2) if llm_ms else None,
        "llm_p99_ms": round(percentile(llm_ms, 0.99), 2) if llm_ms else None,
        "overhead_p50_ms": round(percentile(overhead, 0.5), 2),
        "overhead_p99_ms": round(percentile(overhead, 0.99), 2),
        "handler_overhead_p50_ms": round(percentile(handler_overhead, 0.5), 2) if ok else None,
        "handler_overhead_p99_ms": round(percentile(handler_overhead, 0.99), 2) if ok else None,
        "overhead_p99_llm_answers_ms": round(percentile(llm_overhead, 0.99), 2) if llm_overhead else None,
        "generator_lag_p99_ms": round(percentile([s.sent_lag_ms for s in samples], 0.99), 2),
    }  # fmt: skip


async def _start_service(
    stack_dir: Path,
    prefix: str,
    replicas: int,
    per_replica: int,
    root: Path = REPO,
    extra_env: dict[str, str] | None = None,
) -> ServedProcess:
    """``shopper realtime serve`` from the checkout at ``root`` (another commit's, to compare), with
    ``extra_env`` (``REALTIME_*`` settings) on top of the bench's own."""
    env = {
        "SINK_REDIS_KEY_PREFIX": prefix,
        "REALTIME_LLM_CONCURRENCY_PER_REPLICA": str(per_replica),
        **(extra_env or {}),
    }
    args = ["--replicas", str(replicas), "--state-dir", str(stack_dir)]
    return await start_realtime_service(args, env, root)


def _set_slowdown(stack: StackState, slowdown: float) -> None:
    for url in stack.llm_endpoints:
        request = urllib.request.Request(
            url + "/admin/config", data=json.dumps({"slowdown": slowdown}).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        urllib.request.urlopen(request, timeout=5).read()


async def _calibrate(
    url: str, stack: StackState, target_ms: float, products: list[str], shoppers: int
) -> float:
    """Slow the replicas down until an unloaded ranking call takes ``target_ms``."""
    slowdown = 1.0
    rng = random.Random(1)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            measured = []
            for _ in range(12):
                body = _body(rng, products, shoppers, 3000)
                async with session.post(
                    url + "/v1/match", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    answer = await r.json()
                if answer["llm_ms"] and not answer["degraded"]:
                    measured.append(answer["llm_ms"])
                await asyncio.sleep(0.02)
            median = statistics.median(measured)
            if abs(median - target_ms) / target_ms < 0.05:
                break
            slowdown *= target_ms / median
            _set_slowdown(stack, slowdown)
    return slowdown


@contextlib.contextmanager
def _replica_stack(args: argparse.Namespace) -> Iterator[StackState]:
    """The throwaway stack, its replicas noticing a gone client every ``--replica-poll-s`` of wall time.

    The time scale makes the simulated replicas answer a ranking call in about 150 ms (a model that
    fast), but trtllm-serve's disconnect poll is a wall-clock second whatever the model's speed
    (``docs/simulator.md``); scaled with the rest, it came every 30 ms here, so a call cut at its
    deadline was abandoned about 30 times sooner than a real replica would."""
    poll = str(args.replica_poll_s / args.time_scale) if args.time_scale > 0 else "0"
    saved = os.environ.get("SIM_DISCONNECT_POLL_S")
    os.environ["SIM_DISCONNECT_POLL_S"] = poll  # the replicas' processes read SIM_* as they start
    try:
        with temporary_stack(replicas=args.replicas, time_scale=args.time_scale) as stack:
            yield stack
    finally:
        if saved is None:
            os.environ.pop("SIM_DISCONNECT_POLL_S", None)
        else:
            os.environ["SIM_DISCONNECT_POLL_S"] = saved


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"bench-rt-{int(time.time())}:"
    load_before = os.getloadavg()
    results = []
    with _replica_stack(args) as stack:
        stack_dir = Path(stack.processes[0].log).parent.parent
        products = await _write_signals(stack, prefix, args.shoppers)
        service = await _start_service(stack_dir, prefix, args.replicas, args.per_replica, args.service_root)
        url = service.url
        try:
            slowdown = await _calibrate(url, stack, args.llm_ms, products, args.shoppers)
            print(f"replica slowdown {slowdown:.3f} for ~{args.llm_ms:.0f} ms ranking calls", flush=True)
            await open_loop(
                url, args.rate / 4, 3, args.deadline_ms, products, args.shoppers, seed=0
            )  # warm-up
            phases = [
                ("nominal", args.rate, args.seconds),
                ("overload 2x", 2 * args.rate, args.overload_seconds),
            ]
            pids = {
                "service": [service.pid],
                "replicas": [p.pid for p in stack.processes if p.name.startswith("sim-")],
                "generator": [os.getpid()],
            }
            for i, (name, rate, seconds) in enumerate(phases):
                print(f"{name}: {rate:.0f} req/s for {seconds:.0f} s", flush=True)
                before = {k: sum(process_cpu_seconds(p) for p in group) for k, group in pids.items()}
                counted = await _service_counters(url)
                connections = await _connection_counters(url)
                samples = await open_loop(
                    url, rate, seconds, args.deadline_ms, products, args.shoppers, seed=i + 1,
                    request_start=args.request_start,
                )  # fmt: skip
                summary = summarise(name, rate, samples)
                summary["cpu_ms_per_request"] = _cpu_per_request(pids, before, len(samples))
                summary["service_cpu_ms_per_request"] = _service_cpu_ms(counted, await _service_counters(url))
                # After the phase's cut calls have had their grace (the service's is 0.25 s).
                await asyncio.sleep(1)
                for key, value in (await _connection_counters(url)).items():
                    summary[key] = round(value - connections.get(key, 0.0))
                results.append(summary)
                await asyncio.sleep(2)
        finally:
            await service.stop()
            with contextlib.suppress(Exception):
                import redis as sync_redis

                client = sync_redis.Redis.from_url(stack.redis_url)
                keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
                if keys:
                    client.delete(*keys)
    return {
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "replica_poll_s": args.replica_poll_s,
        "slowdown": round(slowdown, 3),
        "llm_concurrency_per_replica": args.per_replica,
        "deadline_ms": args.deadline_ms,
        "request_start": args.request_start,
        "service_root": str(args.service_root),
        "phases": results,
    }


@dataclass(frozen=True)
class Arm:
    """One service of an equal-work comparison: ``LABEL=ROOT[,VAR=VALUE...]`` on the command line."""

    label: str
    root: Path
    env: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Arm:
        label, _, rest = text.partition("=")
        root, *settings = rest.split(",")
        if not label or not root or any("=" not in v for v in settings):
            raise argparse.ArgumentTypeError(f"--arm takes LABEL=ROOT[,VAR=VALUE...], not {text!r}")
        return cls(label, Path(root).resolve(), dict(v.split("=", 1) for v in settings))


async def closed_loop(
    url: str, requests: int, concurrency: int, deadline_ms: int, products: list[str], shoppers: int, seed: int
) -> list[Sample]:
    """``requests`` requests from ``concurrency`` callers, each sending its next as soon as it has its
    answer: the same work for every service compared, whatever the machine's load does to the rate."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    bodies = [_body(rng, products, shoppers, deadline_ms) for _ in range(requests)]
    samples: list[Sample] = []
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=deadline_ms / 1000 + 2.0)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def caller() -> None:
            while bodies:
                body = bodies.pop()
                sent = loop.time()
                status, reason, llm_ms, elapsed = 0, None, None, None
                try:
                    async with session.post(url + "/v1/match", data=body, headers=headers) as r:
                        raw = await r.read()
                        status = r.status
                    if status == 200:
                        answer = orjson.loads(raw)
                        reason, llm_ms, elapsed = (
                            answer["degraded_reason"],
                            answer["llm_ms"],
                            answer["elapsed_ms"],
                        )
                except (aiohttp.ClientError, TimeoutError):
                    status = -1
                latency = (loop.time() - sent) * 1000
                samples.append(Sample(sent, 0.0, latency, status, reason, llm_ms, deadline_ms, elapsed))

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return samples


PROFILE_PACKAGES: list[tuple[str, tuple[str, ...]]] = [
    ("realtime/ (this service)", ("(realtime/", "(prompt_assembly/")),
    ("llm_client/", ("(llm_client/",)),
    ("aiohttp (server and client)", ("(aiohttp/", "(multidict/", "(yarl/")),
    ("redis client", ("(redis/",)),
    ("pydantic (request validation)", ("(pydantic/", "(pydantic_core/")),
    ("prometheus_client", ("(prometheus_client/",)),
    ("asyncio in Python (loop, tasks, timeouts, streams)", ("(asyncio/", "(uvloop/", "(selectors.py")),
]
"""A py-spy sample is counted for the innermost frame whose file is in one of these (its own time, by
package); a sample in none of them (the standard library's other modules, the interpreter) is 'other'.
Two kinds of sample are told apart first, by the innermost frame itself (``PROFILE_CALLS``)."""

PROFILE_CALLS: list[tuple[str, tuple[str, ...]]] = [
    (
        "socket writes (the send system calls)",
        (
            "_SelectorSocketTransport.write (",
            "_SelectorSocketTransport.writelines (",
            "StreamWriter._writelines (aiohttp/http_writer.py",
            "StreamWriter.writelines (asyncio/streams.py",
        ),
    ),
    ("uvloop's C loop (polling, reads, callbacks)", ("Runner.run (asyncio/runners.py",)),
]
"""Samples whose innermost Python frame is one of these: a socket write (with uvloop the write itself is
C, so the sample stops at the Python line that calls it), or uvloop's loop, which runs in C under
``asyncio.Runner.run``."""


def summarise_collapsed(path: Path) -> dict[str, float]:
    """Shares of on-CPU samples by package, from py-spy's ``raw`` (collapsed stacks) output (empty when
    py-spy wrote nothing: it could not attach)."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        part = next((name for name, marks in PROFILE_CALLS if frames[-1].startswith(marks)), "other")
        for frame in reversed(frames) if part == "other" else ():
            found = next((name for name, marks in PROFILE_PACKAGES if any(m in frame for m in marks)), None)
            if found is not None:
                part = found
                break
        counts[part] += int(n)
    total = sum(counts.values()) or 1
    return {part: round(n / total, 3) for part, n in counts.most_common()}


async def _profiled_round(pid: int, out: Path, round_: Any) -> tuple[list[Sample], dict[str, float]]:
    """One round with py-spy sampling the service: on-CPU samples only, each taken with the process
    paused (consistent stacks; the round runs slower, which is why it is not one of the timed ones)."""
    py_spy = Path(sys.executable).parent / "py-spy"
    argv = [str(py_spy), "record", "--pid", str(pid), "-r", "250", "-f", "raw", "-o", str(out)]
    spy = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    await asyncio.sleep(1.0)  # attached
    samples = await round_()
    spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
    await asyncio.wait_for(spy.wait(), 30)
    return samples, summarise_collapsed(out)


def _round_summary(samples: list[Sample], cpu_ms: float | None) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    by_model = [s for s in ok if s.degraded_reason is None and s.llm_ms is not None]
    overhead = [s.latency_ms - (s.llm_ms or 0.0) for s in by_model]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "answered_by_model": len(by_model),
        "service_cpu_ms_per_request": cpu_ms,
        "overhead_p50_ms": round(percentile(overhead, 0.5), 2) if overhead else None,
        "overhead_p99_ms": round(percentile(overhead, 0.99), 2) if overhead else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


async def equal_work(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``--arm``'s service on one stack; rounds alternate between them (ABBA order), each the same
    closed-loop work, and CPU per request comes from each service's own counter."""
    arms: list[Arm] = args.arm
    prefix = f"bench-rt-{int(time.time())}:"
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, float]] = {}
    with _replica_stack(args) as stack:
        stack_dir = Path(stack.processes[0].log).parent.parent
        products = await _write_signals(stack, prefix, args.shoppers)
        services: dict[str, ServedProcess] = {}
        try:
            for arm in arms:
                services[arm.label] = await _start_service(
                    stack_dir, prefix, args.replicas, args.per_replica, arm.root, arm.env
                )
            slowdown = await _calibrate(
                services[arms[0].label].url, stack, args.llm_ms, products, args.shoppers
            )
            print(f"replica slowdown {slowdown:.3f} for ~{args.llm_ms:.0f} ms ranking calls", flush=True)
            deadline_ms = 3000  # every request waits for the model: equal work

            def work(url: str, seed: int) -> Any:
                return lambda: closed_loop(
                    url, args.round_requests, args.concurrency, deadline_ms, products, args.shoppers, seed
                )

            for arm in arms:  # warm-up: connections, caches, the model-time window
                await work(services[arm.label].url, 0)()
            for r in range(args.rounds):
                order = arms if r % 2 == 0 else arms[::-1]
                row: dict[str, Any] = {"round": r + 1}
                for arm in order:
                    url = services[arm.label].url
                    before = await _service_counters(url)
                    samples = await work(url, r + 1)()
                    row[arm.label] = _round_summary(
                        samples, _service_cpu_ms(before, await _service_counters(url))
                    )
                rounds.append(row)
                print(
                    f"round {r + 1}: "
                    + ", ".join(f"{a.label} {row[a.label]['service_cpu_ms_per_request']} ms" for a in arms),
                    flush=True,
                )
            if args.profile_dir is not None:  # after the timed rounds: profiling never disturbs them
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                for arm in arms:
                    service = services[arm.label]
                    out = args.profile_dir / f"realtime-{arm.label}.collapsed.txt"
                    _, profiles[arm.label] = await _profiled_round(service.pid, out, work(service.url, 99))
                    print(f"profiled {arm.label} -> {out}: {profiles[arm.label]}", flush=True)
        finally:
            for service in services.values():
                await service.stop()
    first = arms[0].label
    summary = {}
    for arm in arms:
        cpu = [row[arm.label]["service_cpu_ms_per_request"] for row in rounds]
        ratios = [
            row[arm.label]["service_cpu_ms_per_request"] / row[first]["service_cpu_ms_per_request"]
            for row in rounds
        ]
        summary[arm.label] = {
            "root": str(arm.root),
            "env": arm.env,
            "cpu_ms_median": round(statistics.median(cpu), 3),
            "ratio_to_first_median": round(statistics.median(ratios), 3),
            "ratio_to_first_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "overhead_p50_ms_median": statistics.median(row[arm.label]["overhead_p50_ms"] for row in rounds),
            "overhead_p99_ms_median": statistics.median(row[arm.label]["overhead_p99_ms"] for row in rounds),
        }
    return {
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "replica_poll_s": args.replica_poll_s,
        "concurrency": args.concurrency,
        "round_requests": args.round_requests,
        "arms": summary,
        "rounds": rounds,
        "profiles": profiles,
    }


def report_equal_work(result: dict[str, Any]) -> None:
    loads = f"{result['load_average_before']} -> {result['load_average_after']}"
    print(f"\nmachine: {result['machine']}; load average {loads}")
    print(
        f"equal work: {result['round_requests']} requests a round from {result['concurrency']} callers, "
        "every one answered by the model\n"
    )
    labels = list(result["arms"])
    print_table(
        ["round", "load", *(f"{a} CPU ms/req" for a in labels), *(f"{a} / {labels[0]}" for a in labels[1:])],
        [
            [row["round"], row[labels[0]]["load_average"],
             *(row[a]["service_cpu_ms_per_request"] for a in labels),
             *(round(row[a]["service_cpu_ms_per_request"] / row[labels[0]]["service_cpu_ms_per_request"], 3)
               for a in labels[1:])]
            for row in result["rounds"]
        ],
    )  # fmt: skip
    for label, arm in result["arms"].items():
        print(
            f"  {label}: CPU median {arm['cpu_ms_median']} ms/req, ratio to {labels[0]} "
            f"{arm['ratio_to_first_median']} (rounds {arm['ratio_to_first_range']}); overhead p50/p99 "
            f"{arm['overhead_p50_ms_median']} / {arm['overhead_p99_ms_median']} ms"
        )
    for label, shares in result["profiles"].items():
        print(f"  profile {label}: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))


def report(result: dict[str, Any]) -> None:
    loads = f"{result['load_average_before']} -> {result['load_average_after']}"
    print(f"\nmachine: {result['machine']}; load average {loads}")
    speed = f"time scale {result['time_scale']} x slowdown {result['slowdown']}"
    admitted = f"{result['llm_concurrency_per_replica']} calls per replica admitted"
    print(f"{result['replicas']} replicas ({speed}), {admitted}, deadline {result['deadline_ms']} ms\n")
    rows = [
        [p["phase"], p["offered_rps"], p["requests"], p["errors"], p.get("refused", 0), p["late"],
         p["degraded_pct"], p["llm_p50_ms"], p["latency_p99_ms"], p["latency_max_ms"], p["overhead_p50_ms"],
         p["overhead_p99_ms"], p.get("service_cpu_ms_per_request")]
        for p in result["phases"]
    ]  # fmt: skip
    print_table(
        ["phase", "req/s", "requests", "errors", "refused", "late answers", "degraded %", "LLM p50 ms",
         "p99 ms", "max ms", "overhead p50 ms", "overhead p99 ms", "service CPU ms/req"],
        rows,
    )  # fmt: skip
    for p in result["phases"]:
        print(
            f"  {p['phase']}: degraded {p['degraded']}; generator lag p99 {p['generator_lag_p99_ms']} ms; "
            f"service-side p99 {p['service_p99_ms']} ms, late inside the service {p['late_in_service']}"
        )
        print(
            f"    refused {p.get('refused', 0)} (after their deadline: {p.get('refused_late', 0)}, "
            f"p99 {p.get('refusal_p99_ms')} ms); errors or timeouts after the deadline "
            f"{p.get('late_other', 0)}"
        )
        print(f"    CPU ms per request (/proc): {p['cpu_ms_per_request']}")
        print(
            f"    Redis signal reads failed or timed out: {p.get('signal_errors')}; model calls cut at "
            f"their deadline, read to the end within the grace {p.get('cut_kept')}, closed "
            f"{p.get('cut_closed')}, closed at once {p.get('cut_closed_at_once')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=None, help="default 30 (--quick: 10)")
    parser.add_argument("--overload-seconds", type=float, default=None, help="default 20 (--quick: 10)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--per-replica", type=int, default=24, help="calls admitted per replica")
    parser.add_argument("--time-scale", type=float, default=0.03)
    parser.add_argument(
        "--replica-poll-s",
        type=float,
        default=1.0,
        help="wall seconds between the replicas' disconnect polls (trtllm-serve's: 1; before 2 Dec 2026 "
        "the bench scaled it with the time scale, 0.03)",
    )
    parser.add_argument("--llm-ms", type=float, default=150.0)
    parser.add_argument("--deadline-ms", type=int, default=300)
    parser.add_argument("--shoppers", type=int, default=500)
    parser.add_argument(
        "--no-request-start",
        dest="request_start",
        action="store_false",
        help="send no X-Request-Start: the service counts deadlines from arrival",
    )
    parser.add_argument(
        "--service-root",
        type=Path,
        default=REPO,
        help="run the service from this checkout (e.g. a git worktree of an older commit, to compare)",
    )
    parser.add_argument(
        "--arm",
        type=Arm.parse,
        action="append",
        help="LABEL=ROOT[,VAR=VALUE...]: a service to compare at equal work (repeat; the first is the "
        "reference of the ratios)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="equal work: rounds per service")
    parser.add_argument("--round-requests", type=int, default=1500, help="equal work: requests a round")
    parser.add_argument("--concurrency", type=int, default=32, help="equal work: callers")
    parser.add_argument(
        "--profile-dir", type=Path, default=None, help="equal work: py-spy one more round of each service"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="10 s phases (an explicit --seconds or --overload-seconds wins); writes realtime_quick.json "
        "unless --out is given",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results name (default realtime, realtime_cpu with --arm; with --quick, _quick appended)",
    )
    args = parser.parse_args()
    if args.seconds is None:  # --quick's presets fill in only what the command line left out
        args.seconds = 10.0 if args.quick else 30.0
    if args.overload_seconds is None:
        args.overload_seconds = 10.0 if args.quick else 20.0
    if args.arm:
        result = asyncio.run(equal_work(args))
        report_equal_work(result)
    else:
        result = asyncio.run(bench(args))
        report(result)
    if not args.out:  # a smoke run never overwrites the full run's results
        args.out = ("realtime_cpu" if args.arm else "realtime") + ("_quick" if args.quick else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {RESULTS / args.out}.json")


if __name__ == "__main__":
    main()
