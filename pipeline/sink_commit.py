"""The group committer of the Flink job's async sink stage.

Why this shape: PyFlink gives Python functions no checkpoint hook, but its async operator drains every
in-flight call before a bundle ends, and a bundle always ends before a checkpoint barrier passes. So a
result's async call completes only once it is *durable* in every sink (``Checkpoint.make_durable``);
then every checkpoint covers only results that are stored (at-least-once; the sinks are idempotent, so
effectively once in storage).

- Results are written to the sinks in small batches as soon as they arrive (Redis is what ad servers
  read; freshness counts).
- The sinks are flushed when one says it is due (S3 by size/age), or once no new result has arrived
  for ``idle_flush_s``: that is what a bundle end looks like from here (the operator stops feeding calls
  while it drains), so a drain waits about ``idle_flush_s``, not ``s3_max_age_s``.
A write that still fails after the retry policy fails every waiting call: the job restarts from the
last checkpoint and replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from pipeline.checkpoint import Checkpoint
from prompt_assembly.records import EnrichmentResult


class SinkCommitter:
    """Group commit for a PyFlink async operator, through a ``pipeline.checkpoint.Checkpoint`` (its
    sinks only: the dead letters and offsets are Flink's, in the same order, see that module)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        idle_flush_s: float = 0.02,
        max_batch: int = 512,
        on_written: Callable[[Sequence[EnrichmentResult]], None] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.idle_flush_s = idle_flush_s
        self.max_batch = max_batch
        self.on_written = on_written
        self._incoming: list[tuple[EnrichmentResult, asyncio.Future[None]]] = []
        self._awaiting_flush: list[asyncio.Future[None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._opened = False
        self._last_arrival = time.monotonic()
        self.batches = 0
        self.flushes = 0
        self.error: BaseException | None = None
        """The write failure that stopped this committer; every later ``submit`` raises it."""

    async def submit(self, result: EnrichmentResult) -> None:
        """Returns once ``result`` is written to every sink and flushed; raises if a write failed."""
        if self.error is not None:
            raise self.error
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="sink-committer")
        assert self._wake is not None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._incoming.append((result, future))
        self._last_arrival = time.monotonic()
        self._wake.set()
        await future

    async def _run(self) -> None:
        assert self._wake is not None
        try:
            if not self._opened:
                await self.checkpoint.open()
                self._opened = True
            while True:
                if not self._incoming:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.idle_flush_s):
                            await self._wake.wait()
                if self._incoming:
                    await self._write_batch()
                idle = time.monotonic() - self._last_arrival >= self.idle_flush_s
                if self._awaiting_flush and (idle or self.checkpoint.due()):
                    await self.checkpoint.make_durable()
                    self.flushes += 1
                    waiting, self._awaiting_flush = self._awaiting_flush, []
                    for future in waiting:
                        if not future.done():
                            future.set_result(None)
        except asyncio.CancelledError:
            self._fail(RuntimeError("sink committer stopped"))
            raise
        except Exception as exc:
            self.error = exc
            self._fail(exc)

    async def _write_batch(self) -> None:
        batch, self._incoming = self._incoming[: self.max_batch], self._incoming[self.max_batch :]
        results = [result for result, _ in batch]
        try:
            await self.checkpoint.write(results)
        except BaseException:
            self._incoming[:0] = batch
            raise
        if self.on_written is not None:
            self.on_written(results)
        self.batches += 1
        self._awaiting_flush.extend(future for _, future in batch)

    def _fail(self, exc: BaseException) -> None:
        for future in [*self._awaiting_flush, *(f for _, f in self._incoming)]:
            if not future.done():
                future.set_exception(exc)
        self._awaiting_flush, self._incoming = [], []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.checkpoint.close()
