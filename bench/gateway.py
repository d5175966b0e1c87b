"""The routing gateway's cost: added latency against in-process routing, and its throughput ceiling.

Same simulator replicas, same prompts, same policy, one run; each policy in turn. Two paths:

- **in-process**: ``LLMClient.chat`` in the load generator routes to the replicas itself (streamed);
- **gateway**: a bare aiohttp caller posts the same OpenAI body (streamed, usage included) to
  ``shopper router serve`` (a separate process, as callers would use it), which routes with its own
  ``LLMClient`` and passes the answer through.

1. Fixed rate (one open loop at ``--rate`` whose requests alternate between the paths, so both see the
   same moments of a shared machine's load; each path has its own shoppers, whose prompts grow a line
   per visit): p50/p99 of time to first token and of end-to-end latency; *added* = gateway - in-process.
2. Ceiling (closed loop, ``--concurrency`` callers, simulator answering instantly): requests/s of each
   path, and the gateway process's CPU time per request (from /proc), which says what one gateway core
   can carry once the replicas are on other machines.

    python -m bench.gateway [--replicas 3] [--rate 50] [--seconds 16] [--policies a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.common import machine, percentile, print_table, process_cpu_seconds, results_dir
from devstack.served_process import ServedProcess, start_served
from llm_client import ClientConfig, LLMClient
from prompt_assembly.prompt import build_messages
from serving.simulator.launch import REPO_ROOT, SimulatorFleet

Call = Callable[[int], Awaitable[tuple[float, float]]]
"""One request; returns (time to first token ms, end-to-end ms)."""


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    errors: int = 0


def shopper_messages(i: int, shoppers: int, events: int, tag: str) -> tuple[str, list[dict[str, str]]]:
    """Shopper ``i % shoppers`` of the population ``tag`` with a log that grows by one line per visit
    (prefix-stable, as in production: the replica holding the previous prompt can skip most of the
    prefill). Each path has its own population, so neither warms the other's caches."""
    shopper = f"{tag}-shopper-{i % shoppers}"
    n = events + i // shoppers
    lines = [
        f"- 2026-11-22 10:{k % 60:02d} viewed: <data>{shopper} lantern {k} with a long title</data> by "
        f"Brand{k % 7}, Decor > Indoor, ${k}.49\n"
        for k in range(n)
    ]
    return shopper, build_messages(shopper, lines)


async def start_gateway(urls: list[str], policy: str) -> ServedProcess:
    """``shopper router serve`` over ``urls`` with ``policy``, as callers run it: a process of its own."""
    argv = [sys.executable, "-m", "shopper", "router", "serve", "--port", "0", "--policy", policy]
    for url in urls:
        argv += ["--endpoint", url]
    return await start_served(argv, {"LLM_MAX_IN_FLIGHT": "4096"}, REPO_ROOT)


async def open_loop(call: Call, rate: float, seconds: float, into: Samples) -> None:
    async def one(i: int) -> None:
        try:
            ttft, total = await call(i)
        except Exception:
            into.errors += 1
            return
        into.ttft.append(ttft)
        into.total.append(total)

    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)


async def closed_loop(call: Call, concurrency: int, seconds: float) -> tuple[int, float, Samples]:
    samples = Samples()
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            try:
                ttft, total = await call(next(counter))
            except Exception:
                samples.errors += 1
                continue
            samples.ttft.append(ttft)
            samples.total.append(total)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(samples.total), time.perf_counter() - started, samples


class Paths:
    """The two ways of calling the same replicas."""

    def __init__(
        self, client: LLMClient, session: aiohttp.ClientSession, gateway_url: str, args: argparse.Namespace
    ):
        self.client = client
        self.session = session
        self.gateway_url = gateway_url
        self.args = args
        self.offset = 0
        """Added to the request index, so a later phase continues the shoppers' logs."""

    async def in_process(self, i: int) -> tuple[float, float]:
        shopper, messages = shopper_messages(i + self.offset, self.args.shoppers, self.args.events, "in")
        started = time.perf_counter()
        completion = await self.client.chat(messages, routing_key=shopper, max_tokens=self.args.max_tokens)
        total = (time.perf_counter() - started) * 1000
        # The client times its first token from the attempt's start; count from the call's start, as the
        # gateway path does (so routing and queueing in the client are in both).
        return total - completion.latency_ms + completion.ttft_ms, total

    async def via_gateway(self, i: int) -> tuple[float, float]:
        shopper, messages = shopper_messages(i + self.offset, self.args.shoppers, self.args.events, "gw")
        body = {
            "model": self.client.config.model,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft: float | None = None
        async with self.session.post(
            self.gateway_url + "/v1/chat/completions", data=orjson.dumps(body),
            headers={"x-session-id": shopper, "content-type": "application/json"},
        ) as response:  # fmt: skip
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            async for _chunk in response.content.iter_any():
                if ttft is None:
                    ttft = (time.perf_counter() - started) * 1000
            total = (time.perf_counter() - started) * 1000
        return (ttft if ttft is not None else total), total


async def fixed_rate(args: argparse.Namespace) -> list[list[object]]:
    """Per policy: one open loop whose requests alternate between the paths."""
    rows: list[list[object]] = []
    async with SimulatorFleet(args.replicas, "--time-scale", str(args.time_scale)) as fleet:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for policy in args.policies.split(","):
                rows += await _fixed_rate_policy(args, fleet.urls, session, policy)
    return rows


async def _fixed_rate_policy(
    args: argparse.Namespace, urls: list[str], session: aiohttp.ClientSession, policy: str
) -> list[list[object]]:
    gateway = await start_gateway(urls, policy)
    try:
        config = ClientConfig(endpoints=urls, policy=policy, max_in_flight=4096)
        async with LLMClient(config) as client:
            paths = Paths(client, session, gateway.url, args)
            calls = (paths.in_process, paths.via_gateway)
            results = (Samples(), Samples())

            async def interleaved(i: int) -> tuple[float, float]:
                """Even requests in-process, odd ones through the gateway: both paths see the same
                moments of the machine's load, so its swings cannot favour one of them."""
                return await calls[i % 2](i // 2)

            async def record(i: int) -> None:
                try:
                    ttft, total = await interleaved(i)
                except Exception:
                    results[i % 2].errors += 1
                    return
                results[i % 2].ttft.append(ttft)
                results[i % 2].total.append(total)

            await open_loop(interleaved, args.rate, 2.0, Samples())  # warm: connections, imports, caches
            paths.offset = args.shoppers
            cpu_before = process_cpu_seconds(gateway.pid)
            await _paced(record, args.rate, args.seconds)
            gateway_cpu_s = process_cpu_seconds(gateway.pid) - cpu_before
    finally:
        await gateway.stop()
    base = results[0]
    rows: list[list[object]] = []
    for name, s in zip(("in-process", "gateway"), results, strict=True):
        cpu_us = gateway_cpu_s * 1e6 / len(s.total) if name == "gateway" and s.total else float("nan")
        rows.append(
            [
                policy,
                name,
                len(s.total),
                s.errors,
                percentile(s.ttft, 0.5),
                percentile(s.ttft, 0.99),
                percentile(s.total, 0.5),
                percentile(s.total, 0.99),
                percentile(s.total, 0.5) - percentile(base.total, 0.5),
                percentile(s.total, 0.99) - percentile(base.total, 0.99),
                cpu_us,
            ]
        )
    return rows


async def _paced(one: Callable[[int], Coroutine[Any, Any, None]], rate: float, seconds: float) -> None:
    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)


async def ceiling(args: argparse.Namespace) -> list[list[object]]:
    """Per policy: the in-process client, then the gateway, each for ``seconds``."""
    rows: list[list[object]] = []
    async with SimulatorFleet(args.replicas, "--time-scale", "0") as fleet:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for policy in args.policies.split(","):
                config = ClientConfig(endpoints=fleet.urls, policy=policy, max_in_flight=4096)
                async with LLMClient(config) as client:
                    paths = Paths(client, session, "", args)
                    await closed_loop(paths.in_process, args.concurrency, 1.0)  # warm
                    done, elapsed, s = await closed_loop(paths.in_process, args.concurrency, args.seconds / 4)
                    rows.append(_ceiling_row(policy, "in-process", done, elapsed, s, float("nan")))
                    gateway = await start_gateway(fleet.urls, policy)
                    paths.gateway_url = gateway.url
                    try:
                        await closed_loop(paths.via_gateway, args.concurrency, 1.0)  # warm
                        cpu_before = process_cpu_seconds(gateway.pid)
                        done, elapsed, s = await closed_loop(
                            paths.via_gateway, args.concurrency, args.seconds / 4
                        )
                        cpu_us = (process_cpu_seconds(gateway.pid) - cpu_before) * 1e6 / max(1, done)
                        rows.append(_ceiling_row(policy, "gateway", done, elapsed, s, cpu_us))
                    finally:
                        await gateway.stop()
    return rows


def _ceiling_row(
    policy: str, path: str, done: int, elapsed: float, s: Samples, cpu_us: float
) -> list[object]:
    p50, p99 = percentile(s.total, 0.5), percentile(s.total, 0.99)
    return [policy, path, done, s.errors, done / elapsed, p50, p99, cpu_us]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policies", default="session_affinity,prefix_aware", help="comma-separated")
    parser.add_argument("--rate", type=float, default=50, help="requests/s of the fixed-rate part")
    parser.add_argument(
        "--seconds", type=float, default=16, help="of the fixed-rate loop; a quarter of it per ceiling path"
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.01, help="simulator time scale of the fixed-rate part"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shoppers", type=int, default=200)
    parser.add_argument("--events", type=int, default=40, help="log lines of a shopper's first prompt")
    parser.add_argument("--concurrency", type=int, default=32, help="callers of the ceiling part")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average before: {os.getloadavg()[0]:.1f}")
    print(
        f"{args.replicas} simulator replicas, {args.max_tokens} tokens an answer, streamed; fixed rate "
        f"{args.rate:.0f} req/s (half each path) for {args.seconds:.0f} s at time scale {args.time_scale}"
    )
    latency = asyncio.run(fixed_rate(args))
    table1 = print_table(
        ["policy", "path", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "p50 ms", "p99 ms",
         "added p50 ms", "added p99 ms", "gateway CPU µs/request"],
        latency,
    )  # fmt: skip
    print(f"\nceiling: closed loop, {args.concurrency} callers, time scale 0 (answers cost only CPU)")
    top = asyncio.run(ceiling(args))
    table2 = print_table(
        ["policy", "path", "requests", "errors", "req/s", "p50 ms", "p99 ms", "gateway CPU µs/request"], top
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(
        json.dumps({"machine": machine(), "args": vars(args), "latency": table1, "ceiling": table2})
    )


if __name__ == "__main__":
    main()
