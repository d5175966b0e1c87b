"""A caller that leaves before its answer: the service started as in production stops working for it.

``shopper realtime serve`` ran without handler cancellation (aiohttp's test server runs with it, so the
tests never saw the difference): a caller that left kept its model call, and its concurrency slot, until
the call ended, and the answer was written to nobody. With the handler cancelled while it waits for
Redis, the signal read it started is left to finish within ``max_late_reads`` or cancelled, as at a
timeout; it was left running outside that bound.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis
from aiohttp import web

from devstack.served_process import realtime_service
from devstack.stack import StackState
from realtime.config import RealtimeSettings
from realtime.service import create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from tests.conftest import Isolated
from tests.realtime.test_realtime_slow_redis import slow_proxy

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _metric(text: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def _send_match(url: str, shopper_id: str) -> Connection:
    """A caller's request on a connection of its own, the answer not read: closing it is leaving."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps({"shopper_id": shopper_id, "candidates": ["a", "b", "c"], "deadline_ms": 5000})
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"POST /v1/match HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


async def _eventually(check: Callable[[], Any], what: str, timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` (a value or an awaitable) is true; fail saying ``what`` did not happen."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                result = check()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:.0f} s: {what}") from None


async def test_a_caller_that_leaves_frees_its_model_call_in_the_served_service(
    stack: StackState, isolated: Isolated
) -> None:
    async with running_simulator(time_scale=1.0) as slow:  # a ranking call takes about a second
        env = {
            "SINK_REDIS_URL": stack.redis_url,
            "SINK_REDIS_KEY_PREFIX": isolated.prefix,
            "LLM_ENDPOINTS": json.dumps([slow.url]),
            "REALTIME_LLM_CONCURRENCY_PER_REPLICA": "2",
        }
        async with realtime_service(["--no-from-stack"], env) as service, aiohttp.ClientSession() as http:

            async def metrics() -> str:
                async with http.get(f"{service.url}/metrics") as response:
                    return await response.text()

            async def in_flight(calls: int) -> bool:
                return _metric(await metrics(), "realtime_llm_in_flight ") == calls

            callers = [await _send_match(service.url, f"s{i}") for i in range(2)]
            await _eventually(lambda: in_flight(2), "both callers' model calls in flight")
            for _, writer in callers:
                writer.close()  # both callers give up
            await _eventually(
                lambda: slow.replica.engine.stats.aborted == 2,
                "the replica aborted the calls of the callers that left",
            )
            await _eventually(lambda: in_flight(0), "the slots of the callers that left are free")
            assert _metric(await metrics(), "realtime_requests_total") == 0, "no answer for nobody"

            body = {"shopper_id": "next", "candidates": ["a", "b"], "deadline_ms": 5000}
            async with http.post(f"{service.url}/v1/match", json=body) as response:
                answer = await response.json()
            assert response.status == 200 and answer["degraded_reason"] != "overloaded", answer


def _signal_reads() -> list[asyncio.Task[Any]]:
    """The signal reads running in this process (``SignalReader.read`` tasks)."""
    tasks = asyncio.all_tasks()
    return [t for t in tasks if getattr(t.get_coro(), "__qualname__", None) == "SignalReader.read"]


async def test_callers_that_leave_during_the_signal_read_leave_at_most_max_late_reads(
    stack: StackState, isolated: Isolated
) -> None:
    async with slow_proxy(stack.redis_url) as proxy:
        redis = aioredis.Redis.from_url(proxy.url)
        app = create_app(
            RealtimeSettings(redis_timeout_ms=10_000, max_late_reads=2),  # the read waits for the deadline
            llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
            sinks=isolated.sinks(),
            redis=redis,
        )
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)  # as `serve` runs it
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                body = {"shopper_id": "s1", "candidates": ["a"], "deadline_ms": 5000}
                async with http.post(f"{url}/v1/match", json=body) as response:
                    assert response.status == 200  # the pool's first connection, answered in time
                proxy.delay_s = 60.0  # Redis answers nothing within the test
                callers = [await _send_match(url, f"s{i}") for i in range(6)]
                await _eventually(lambda: len(_signal_reads()) == 6, "every caller's read started")
                for _, writer in callers:
                    writer.close()
                await _eventually(
                    lambda: len(_signal_reads()) <= 2,
                    "at most max_late_reads (2) reads left running by the callers that left",
                )
                async with http.get(f"{url}/metrics") as response:
                    metrics = await response.text()
        finally:
            await runner.cleanup()
            await redis.aclose()
    assert _metric(metrics, "realtime_late_signal_reads ") == 2, "kept: their connections go back to the pool"
