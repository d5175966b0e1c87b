"""A network link with a one-way delay, for a broker that is not on this machine's loopback.

Kafka's clients behave differently once a round trip is longer than the gap between two records: the
producer's queue is then never empty. A Tansu broker of the test's own advertises the link's port, so
every connection a client makes (bootstrap and the broker it is told of) crosses the link. The link is
an asyncio proxy on a thread of its own: each chunk read is written on after ``delay_s``, in order, so
the delay adds latency without limiting throughput (``tc netem`` would need root and delay everything
on the loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from devstack.processes import free_port, spawn, stop, wait_for_port
from devstack.stack import tansu_binary

CHUNK = 65536


class SlowLink:
    """``127.0.0.1:port`` forwards to ``127.0.0.1:target_port``, each direction ``delay_s`` late."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slow-link", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        started.result(timeout=10)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", self.port)

    async def _connect(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # the link stops: the loop goes with it
            await asyncio.gather(
                self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
            )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Reads as fast as the peer sends; each chunk goes on ``delay_s`` after it was read."""
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                at, chunk = await due.get()
                if not chunk:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                writer.write(chunk)
                await writer.drain()
            writer.close()

        forwarding = asyncio.create_task(forward())
        try:
            while chunk := await reader.read(CHUNK):
                due.put_nowait((time.monotonic() + self.delay_s, chunk))
        except ConnectionError:
            pass
        due.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError):
            await forwarding

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@contextlib.contextmanager
def tansu_behind_slow_link(directory: Path, delay_s: float) -> Iterator[str]:
    """A Tansu broker (in-memory storage) that clients reach only over a ``SlowLink``: it advertises the
    link's port. Yields the bootstrap address."""
    broker_port = free_port()
    link = SlowLink(broker_port, delay_s)
    url = f"tcp://127.0.0.1:{broker_port}"
    argv = [tansu_binary(), "broker", "--listener-url", url]
    argv += ["--advertised-listener-url", f"tcp://127.0.0.1:{link.port}"]
    process = spawn("tansu-slow-link", argv, broker_port, directory)
    try:
        wait_for_port(process)
        link.start()
        try:
            yield f"127.0.0.1:{link.port}"
        finally:
            link.stop()
    finally:
        stop(process)
