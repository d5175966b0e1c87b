"""Client overhead: LLMClient (routing, retry bookkeeping, deadline, backpressure, usage parsing)
versus a bare aiohttp POST, against the same instant-answer server, open-loop at a fixed rate.
Overhead = client latency percentile - bare latency percentile, measured in one run, alternating.

    python -m bench.client_overhead [--rate 2000] [--seconds 5] [--interleave]

``--interleave`` sends even requests bare and odd ones through the client within one open loop (each
path at half the rate, both under the same total load and machine state), which takes the drift
between rounds out of the comparison on a shared machine.

``--cpu-rounds N`` measures CPU instead of latency: rounds of ``--cpu-calls`` calls from 16 callers in
closed loop, alternating bare and client (ABBA), each round's CPU from this process's own counter
(``time.process_time``); the client's cost is its CPU per call minus the bare path's in the same round
pair. Writes bench/results/client_overhead_cpu.json. To measure another commit's client, run this mode
from a worktree of it (copy this file into its ``bench/`` when it is older than the mode:
``cp bench/client_overhead.py /tmp/old/bench/ && cd /tmp/old && python -m bench.client_overhead
--cpu-rounds 6``).

``--reconnect-rounds N`` prices a new connection: rounds of bare calls over kept-alive connections and
over a new connection each call (``force_close``, what a call cut at its deadline leaves the next one),
alternating (ABBA), CPU per call of this process and of the server process (``/proc``). Writes
bench/results/client_reconnect_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp

import llm_client as llm_client_module
from bench.common import machine, percentile, print_table, process_cpu_seconds, results_dir, write_results
from devstack.processes import ManagedProcess, free_port, stop, wait_for_port
from llm_client import ClientConfig, LLMClient

SERVER = """
import sys
from aiohttp import web
BODY = b'{"model":"m","choices":[{"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],' \\
       b'"usage":{"prompt_tokens":3000,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":2900}}}'
async def chat(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

MESSAGES = [
    {"role": "system", "content": "You describe shoppers. " * 200},
    {"role": "user", "content": "log"},
]


async def open_loop(
    call: Callable[[int], Awaitable[None]], rate: float, seconds: float
) -> tuple[list[float], int]:
    latencies: list[float] = []
    errors = 0
    tasks = []

    async def one(i: int) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            await call(i)
            latencies.append((time.perf_counter() - started) * 1000)
        except Exception:
            errors += 1

    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return latencies, errors


async def bench(
    url: str, rate: float, seconds: float, rounds: int, interleave: bool = False
) -> list[list[object]]:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "stream": False}
    results: dict[str, tuple[list[float], int]] = {"bare aiohttp": ([], 0), "LLMClient": ([], 0)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def bare(i: int) -> None:
            async with session.post(
                url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}
            ) as r:
                json.loads(await r.read())

        config = ClientConfig(endpoints=[url], stream=False, max_in_flight=4096, policy="session_affinity")
        async with LLMClient(config) as client:

            async def ours(i: int) -> None:
                await client.chat(MESSAGES, routing_key=f"s{i % 500}", max_tokens=1)

            await open_loop(bare, rate, 0.5)  # warm both paths
            await open_loop(ours, rate, 0.5)
            for _ in range(rounds):
                if interleave:
                    # One open loop at ``rate``: even requests take the bare path, odd ones the client, so
                    # both see the same machine state and the same load on the event loop.
                    split: dict[str, list[float]] = {"bare aiohttp": [], "LLMClient": []}

                    async def either(i: int, split: dict[str, list[float]] = split) -> None:
                        name = "bare aiohttp" if i % 2 == 0 else "LLMClient"
                        started = time.perf_counter()
                        await (bare(i) if i % 2 == 0 else ours(i))
                        split[name].append((time.perf_counter() - started) * 1000)

                    _, err = await open_loop(either, rate, seconds)
                    for name, lat in split.items():
                        results[name][0].extend(lat)
                    results["LLMClient"] = (results["LLMClient"][0], results["LLMClient"][1] + err)
                    continue
                for name, call in (("bare aiohttp", bare), ("LLMClient", ours)):
                    lat, err = await open_loop(call, rate, seconds)
                    results[name][0].extend(lat)
                    results[name] = (results[name][0], results[name][1] + err)
    bare_lat = results["bare aiohttp"][0]
    rows = []
    for name, (lat, err) in results.items():
        rows.append(
            [
                name,
                len(lat),
                err,
                percentile(lat, 0.5),
                percentile(lat, 0.99),
                percentile(lat, 0.5) - percentile(bare_lat, 0.5),
                percentile(lat, 0.99) - percentile(bare_lat, 0.99),
            ]
        )
    return rows


async def cpu_rounds(url: str, rounds: int, calls: int, callers: int = 16) -> list[dict[str, float]]:
    """Per round pair: CPU microseconds per call of the bare path and of ``LLMClient.chat``."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "stream": False}
    config = ClientConfig(
        endpoints=[url], stream=False, max_in_flight=4096, policy="least_outstanding", model="m"
    )
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        LLMClient(config) as client,
    ):

        async def bare(i: int) -> None:
            async with session.post(
                url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}
            ) as r:
                json.loads(await r.read())

        async def ours(i: int) -> None:
            await client.chat(MESSAGES, routing_key=f"s{i % 500}", max_tokens=1)

        async def closed(call: Callable[[int], Awaitable[None]]) -> float:
            left = list(range(calls))

            async def caller() -> None:
                while left:
                    await call(left.pop())

            started = time.process_time()
            await asyncio.gather(*(caller() for _ in range(callers)))
            return (time.process_time() - started) / calls * 1e6

        await closed(bare)
        await closed(ours)
        out = []
        for r in range(rounds):
            if r % 2 == 0:
                bare_us, ours_us = await closed(bare), await closed(ours)
            else:
                ours_us, bare_us = await closed(ours), await closed(bare)
            out.append({"bare_us": round(bare_us, 1), "client_us": round(ours_us, 1)})
            print(f"round {r + 1}: bare {bare_us:.0f} us/call, LLMClient {ours_us:.0f} us/call", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="one open loop, requests alternating between the two paths (else alternating rounds)",
    )
    parser.add_argument("--cpu-rounds", type=int, default=0, help="closed-loop CPU per call instead")
    parser.add_argument("--cpu-calls", type=int, default=3000, help="calls per path per CPU round")
    parser.add_argument(
        "--reconnect-rounds", type=int, default=0, help="CPU per call, kept-alive against new connections"
    )
    args = parser.parse_args()
    if args.cpu_rounds:
        cpu_main(args.cpu_rounds, args.cpu_calls)
        return
    if args.reconnect_rounds:
        reconnect_main(args.reconnect_rounds, args.cpu_calls)
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], start_new_session=True)
    server = ManagedProcess("echo", proc.pid, port, "-")
    try:
        wait_for_port(server)
        mode = "requests interleaved" if args.interleave else "alternating rounds"
        print(f"machine: {machine()}; open loop at {args.rate:.0f} req/s, {mode}")
        rows = asyncio.run(
            bench(f"http://127.0.0.1:{port}", args.rate, args.seconds, args.rounds, args.interleave)
        )
    finally:
        stop(server)
    table = print_table(
        ["path", "requests", "errors", "p50 ms", "p99 ms", "p50 overhead ms", "p99 overhead ms"], rows
    )
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "client_overhead.json").write_text(
        json.dumps({"machine": machine(), "rate": args.rate, "interleave": args.interleave, "table": table})
    )


@contextlib.contextmanager
def _instant_answer_server(calls: int) -> Iterator[tuple[str, int, float]]:
    """The instant-answer server in its own process: its URL, its pid, the load average at its start."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], start_new_session=True)
    server = ManagedProcess("echo", proc.pid, port, "-")
    load = os.getloadavg()[0]
    try:
        wait_for_port(server)
        print(f"machine: {machine()}; closed loop, 16 callers, {calls} calls a round, load {load:.1f}")
        yield f"http://127.0.0.1:{port}", proc.pid, load
    finally:
        stop(server)


def cpu_main(rounds: int, calls: int) -> None:
    with _instant_answer_server(calls) as (url, _, load):
        result = asyncio.run(cpu_rounds(url, rounds, calls))
    extra = [r["client_us"] - r["bare_us"] for r in result]
    ordered = sorted(extra)
    print(
        f"LLMClient's own CPU per call (client - bare, each round): "
        f"median {ordered[len(ordered) // 2]:.0f} us, "
        f"range {ordered[0]:.0f}-{ordered[-1]:.0f} us"
    )
    write_results(
        "client_overhead_cpu.json",
        {
            "load_average": [load, os.getloadavg()[0]],
            "calls": calls,
            "import_root": str(Path(llm_client_module.__file__).parent.parent),
            "rounds": result,
        },
    )


async def reconnect_rounds(url: str, server_pid: int, rounds: int, calls: int) -> list[dict[str, float]]:
    """Per round: CPU microseconds per bare call, client and server, kept-alive and new connections."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "stream": False}

    async def closed(fresh: bool, n: int, callers: int = 16) -> tuple[float, float]:
        connector = aiohttp.TCPConnector(limit=0, force_close=fresh)
        async with aiohttp.ClientSession(connector=connector) as session:
            left = list(range(n))

            async def caller() -> None:
                while left:
                    left.pop()
                    async with session.post(url + "/v1/chat/completions", json=body) as r:
                        json.loads(await r.read())

            server_started, started = process_cpu_seconds(server_pid), time.process_time()
            await asyncio.gather(*(caller() for _ in range(callers)))
            client_us = (time.process_time() - started) / n * 1e6
            return client_us, (process_cpu_seconds(server_pid) - server_started) / n * 1e6

    await closed(False, calls // 10)
    await closed(True, calls // 10)
    out = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        measured = {fresh: await closed(fresh, calls) for fresh in order}
        (kept_client, kept_server), (new_client, new_server) = measured[False], measured[True]
        out.append(
            {
                "kept_alive_client_us": round(kept_client, 1),
                "kept_alive_server_us": round(kept_server, 1),
                "new_connection_client_us": round(new_client, 1),
                "new_connection_server_us": round(new_server, 1),
            }
        )
        print(
            f"round {r + 1}: kept alive {kept_client:.0f} + {kept_server:.0f} us/call (client + server), "
            f"new connection {new_client:.0f} + {new_server:.0f}",
            flush=True,
        )
    return out


def reconnect_main(rounds: int, calls: int) -> None:
    with _instant_answer_server(calls) as (url, pid, load):
        result = asyncio.run(reconnect_rounds(url, pid, rounds, calls))
    rows = []
    for side in ("client", "server"):
        kept = sorted(r[f"kept_alive_{side}_us"] for r in result)
        new = sorted(r[f"new_connection_{side}_us"] for r in result)
        extra = sorted(r[f"new_connection_{side}_us"] - r[f"kept_alive_{side}_us"] for r in result)
        rows.append(
            [
                side,
                f"{kept[len(kept) // 2]:.0f} ({kept[0]:.0f}-{kept[-1]:.0f})",
                f"{new[len(new) // 2]:.0f} ({new[0]:.0f}-{new[-1]:.0f})",
                f"{extra[len(extra) // 2]:.0f} ({extra[0]:.0f}-{extra[-1]:.0f})",
            ]
        )
    table = print_table(
        [
            "process: CPU us per call, median (range)",
            "kept-alive connection",
            "new connection each call",
            "a new connection's cost",
        ],
        rows,
    )
    write_results(
        "client_reconnect_cpu.json",
        {"load_average": [load, os.getloadavg()[0]], "calls": calls, "rounds": result, "table": table},
    )


if __name__ == "__main__":
    main()
