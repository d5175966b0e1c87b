"""A Redis read past ``redis_timeout_ms`` is given up on, not cancelled: the request answers without
signals, and the read finishes in the background with its connection kept for the next request.

Cancelling it closed the connection, so under overload (half the reads late at 2x) each next read paid
for a new connection and its handshake. Here a TCP proxy started by the test holds Redis's replies back
while the test says so, and counts the connections the service opens through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from devstack.stack import StackState
from realtime.config import RealtimeSettings
from realtime.service import create_app, realtime_client_config
from sinks.keys import RedisKeys
from tests.conftest import Isolated

CANDIDATES = [{"product_id": "KID-witch", "title": "Witch Costume Set"}, "MAK-paint"]


@dataclass
class SlowProxy:
    """Forwards TCP to Redis; while ``delay_s`` is set, each reply chunk waits that long first."""

    target: tuple[str, int]
    delay_s: float = 0.0
    connections: int = 0
    url: str = ""
    _pumps: set[asyncio.Task[None]] = field(default_factory=set)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if delayed and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        for task in (
            asyncio.create_task(self._pump(reader, upstream_writer, delayed=False)),
            asyncio.create_task(self._pump(upstream_reader, writer, delayed=True)),
        ):
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)


@contextlib.asynccontextmanager
async def slow_proxy(redis_url: str) -> AsyncIterator[SlowProxy]:
    parts = urlsplit(redis_url)
    proxy = SlowProxy((parts.hostname or "127.0.0.1", parts.port or 6379))
    server = await asyncio.start_server(proxy._client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy.url = f"redis://127.0.0.1:{port}{parts.path}"
    try:
        yield proxy
    finally:
        server.close()
        for task in list(proxy._pumps):
            task.cancel()


async def _match(client: TestClient[Any, Any]) -> dict[str, Any]:
    body = {"shopper_id": "s1", "query": "witch", "candidates": CANDIDATES, "deadline_ms": 3000}
    response = await client.post("/v1/match", json=body)
    assert response.status == 200
    answer: dict[str, Any] = await response.json()
    return answer


async def test_a_late_redis_read_keeps_its_connection(stack: StackState, isolated: Isolated) -> None:
    async with slow_proxy(stack.redis_url) as proxy:
        redis = aioredis.Redis.from_url(proxy.url)
        app = create_app(
            RealtimeSettings(redis_timeout_ms=40),
            llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
            sinks=isolated.sinks(),
            redis=redis,
        )
        try:
            async with TestClient(TestServer(app)) as client:
                await _match(client)  # the pool's first connection
                opened = proxy.connections
                proxy.delay_s = 0.2  # every read now takes longer than the 40 ms the service waits
                for _ in range(4):
                    answer = await _match(client)
                    assert answer["signals"] == {"shopper": False, "products": 0}  # not waited for
                    await asyncio.sleep(0.4)  # the read the request gave up on finishes meanwhile
                proxy.delay_s = 0.0
                await _match(client)
                metrics = await (await client.get("/metrics")).text()
        finally:
            await redis.aclose()
    assert "realtime_signal_errors_total 4.0" in metrics
    # Cancelled reads each closed their connection: 4 more were opened. Given up on, none is.
    assert proxy.connections - opened == 0


async def test_a_stalled_redis_leaves_at_most_max_late_reads(stack: StackState, isolated: Isolated) -> None:
    """Redis accepts connections and stops answering. Each request's read, given up on at its timeout,
    was kept to finish, one per request for as long as the stall lasted: behind a server that answers
    a new connection's handshake and nothing after, each held a connection too, until the process ran
    out of file descriptors. Past ``max_late_reads`` a late read is cancelled now; every request is
    still answered, without signals. (Here the proxy holds every reply, handshakes included, so the
    reads queue for the pool's one connection rather than each opening one: counted as tasks.)"""
    async with slow_proxy(stack.redis_url) as proxy:
        redis = aioredis.Redis.from_url(proxy.url)
        app = create_app(
            RealtimeSettings(redis_timeout_ms=40, max_late_reads=4),
            llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
            sinks=isolated.sinks(),
            redis=redis,
        )
        try:
            async with TestClient(TestServer(app)) as client:
                await _match(client)
                tasks_before = len(asyncio.all_tasks())
                proxy.delay_s = 60.0  # no reply within the test
                for _ in range(20):
                    answer = await _match(client)
                    assert answer["signals"] == {"shopper": False, "products": 0}
                await asyncio.sleep(0.5)  # cancelled reads (and cut model calls, in their grace) ended
                left = len(asyncio.all_tasks()) - tasks_before
                metrics = await (await client.get("/metrics")).text()
        finally:
            await redis.aclose()
    # The kept reads, and the test proxy's two pumps of the one connection the pool opened meanwhile.
    assert left <= 4 + 2, f"{left} tasks left running"
    assert "realtime_late_signal_reads 4.0" in metrics


@pytest.mark.parametrize("signal_reads", ["script", "pipeline"])
async def test_signal_bytes_that_are_not_text_rank_without_signals_not_a_500(
    stack: StackState, isolated: Isolated, signal_reads: str
) -> None:
    """A product hash holding bytes that are not UTF-8 (a writer's bug, a restore from elsewhere) made
    the read raise a ValueError, which only Redis and socket errors were caught for: every request
    naming that product was a 500. It is a failed signal read now, answered from the fallback."""
    settings = isolated.sinks()
    redis = aioredis.Redis.from_url(stack.redis_url)
    await redis.hset(RedisKeys(settings.redis_key_prefix).product("BAD-bytes"), "title", b"Witch \xe2\x80")
    app = create_app(
        RealtimeSettings(signal_reads=signal_reads),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=settings,
        redis=redis,
    )
    try:
        async with TestClient(TestServer(app)) as client:
            body = {"shopper_id": "s1", "query": "witch", "candidates": ["BAD-bytes", "MAK-paint"]}
            response = await client.post("/v1/match", json=body)
            assert response.status == 200, await response.text()
            assert (await response.json())["signals"] == {"shopper": False, "products": 0}
            metrics = await (await client.get("/metrics")).text()
    finally:
        await redis.aclose()
    assert "realtime_signal_errors_total 1.0" in metrics
