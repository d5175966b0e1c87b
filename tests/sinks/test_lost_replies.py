"""A Redis signal write whose reply was lost, tried again as the engine's retry policy tries it, against a
real Redis behind a TCP proxy started by the test that lets the write through and drops its reply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from prompt_assembly.records import ShopperInsight, request_id
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated
from tests.sinks.test_sinks import insight

LOST_EPOCH, NEW_EPOCH = 1_764_000_000_000, 1_764_000_900_000


@dataclass
class ReplyDroppingProxy:
    """Forwards TCP to Redis. While ``drop_next_script_reply`` is set, the first connection that sends a
    script call (``EVALSHA``) gets nothing back from then on: Redis runs it, the client never hears."""

    target: tuple[str, int]
    drop_next_script_reply: bool = False
    replies_dropped: int = 0
    _muted: set[asyncio.StreamWriter] = field(default_factory=set)
    _pumps: set[asyncio.Task[None]] = field(default_factory=set)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        to_redis = writer is not client
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if to_redis and self.drop_next_script_reply and b"EVALSHA" in data:
                    self.drop_next_script_reply = False
                    self._muted.add(client)
                if not to_redis and client in self._muted:
                    self.replies_dropped += 1
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        for task in (
            asyncio.create_task(self._pump(reader, upstream_writer, writer)),
            asyncio.create_task(self._pump(upstream_reader, writer, writer)),
        ):
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)


@contextlib.asynccontextmanager
async def reply_dropping_proxy(redis_url: str) -> AsyncIterator[tuple[ReplyDroppingProxy, str]]:
    """The proxy, and ``redis_url`` through it."""
    parts = urlsplit(redis_url)
    proxy = ReplyDroppingProxy((parts.hostname or "127.0.0.1", parts.port or 6379))
    server = await asyncio.start_server(proxy._client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield proxy, urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))
    finally:
        server.close()
        for task in list(proxy._pumps):
            task.cancel()


def answer(shopper: str, epoch: int, seq: int) -> ShopperInsight:
    return insight(shopper, seq, f"answer {epoch}:{seq}").model_copy(
        update={"session_epoch": epoch, "request_id": request_id(shopper, epoch, seq)}
    )


async def test_a_write_tried_again_after_its_reply_was_lost_counts_once_as_written(
    isolated: Isolated,
) -> None:
    """A new session's first answer (a reset over the lost session's signal) is written, and its reply
    lost: the client gives up after ``SINK_REDIS_TIMEOUT_S`` and the same sink writes the same results
    again, as ``pipeline.checkpoint`` retries a write. The retry found its own version stored and was
    counted stale, its reset never counted, while the hash said ``resets`` 1. It counts once as
    written now, its reset once; the same answer written again later (a replay) is still stale."""
    direct = RedisSignalSink(isolated.sinks())
    reset = answer("s-retried", NEW_EPOCH, 1)
    async with reply_dropping_proxy(isolated.stack.redis_url) as (proxy, via_proxy):
        settings = isolated.sinks().model_copy(update={"redis_url": via_proxy, "redis_timeout_s": 0.5})
        sink = RedisSignalSink(settings)
        try:
            await direct.write([answer("s-retried", LOST_EPOCH, 4)])  # the lost session's answer is held
            proxy.drop_next_script_reply = True
            with pytest.raises(RedisTimeoutError):
                await sink.write([reset])
            assert proxy.replies_dropped == 1
            assert (await direct.read("s-retried"))["request_id"] == reset.request_id, "the write landed"
            await sink.write([reset])  # the retry
            assert (sink.written, sink.stale_skipped, sink.session_resets) == (1, 0, 1)
            assert sink.lost_replies == 1
            await sink.write([reset])  # the same answer again, not a retry of an unanswered write
            assert (sink.written, sink.stale_skipped, sink.session_resets, sink.lost_replies) == (1, 1, 1, 1)
            stored = await direct.read("s-retried")
            assert (stored["request_id"], stored["resets"]) == (reset.request_id, "1")
        finally:
            await sink.close()
            await direct.close()
