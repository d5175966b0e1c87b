"""The sink commit step of both engines: one retry policy for every store, and the group committer
the Flink job's async operator uses.

``SinkRetry`` / ``with_sink_retry``: a store that is down (Redis restarting, S3 unreachable) is waited
for, with capped exponential backoff and jitter, for up to ``max_wait_s``; only then does the write
fail, and the engine stops without committing past it (the runner exits, Flink restarts the job), so a
replay from the last commit stores it. Both engines use the same numbers.

``SinkCommitter``: group commit of results to Redis and S3, shaped for a PyFlink async operator.

Why this shape: PyFlink gives Python functions no checkpoint hook, but its async operator drains every
in-flight call before a bundle ends, and a bundle always ends before a checkpoint barrier passes. So a
result's async call completes only once it is *durable* in both stores; then every checkpoint covers only
results that are stored (at-least-once; both sinks are idempotent, so effectively once in storage).

- Redis is written in small batches as soon as results arrive (what ad servers read; freshness counts).
- S3 objects are flushed when the S3 sink says it is due (size/age), or once no new result has arrived
  for ``idle_flush_s``: that is what a bundle end looks like from here (the operator stops feeding calls
  while it drains), so a drain waits about ``idle_flush_s``, not ``s3_max_age_s``.
A write that still fails after the retry policy fails every waiting call: the job restarts from the
last checkpoint and replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel, Field

from prompt_assembly.records import EnrichmentResult
from sinks.redis import RedisSignalSink
from sinks.s3 import S3InsightSink

T = TypeVar("T")


class SinkRetry(BaseModel):
    """How long a sink write waits for a store that is down before the engine gives up."""

    max_wait_s: float = Field(
        120.0, gt=0, description="a store down longer than this stops the engine (a restart replays)"
    )
    initial_backoff_s: float = Field(0.05, gt=0)
    max_backoff_s: float = Field(2.0, gt=0, description="polls a recovering store at least this often")


async def with_sink_retry(
    write: Callable[[], Awaitable[T]],
    policy: SinkRetry,
    *,
    what: str,
    on_retry: Callable[[str, BaseException], None] | None = None,
    retry_if: Callable[[BaseException], bool] = lambda _: True,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``write()``, retried on an error ``retry_if`` accepts (any, by default) until it succeeds or
    ``policy.max_wait_s`` has passed (then the last error is raised). Writes must be idempotent: every
    sink here is."""
    started = clock()
    backoff = policy.initial_backoff_s
    while True:
        try:
            return await write()
        except Exception as exc:
            if not retry_if(exc) or clock() - started + backoff > policy.max_wait_s:
                raise
            if on_retry is not None:
                on_retry(what, exc)
            await asyncio.sleep(random.uniform(backoff / 2, backoff))
            backoff = min(policy.max_backoff_s, backoff * 2)


class SinkCommitter:
    def __init__(
        self,
        redis: RedisSignalSink,
        s3: S3InsightSink,
        *,
        idle_flush_s: float = 0.02,
        max_batch: int = 512,
        retry: SinkRetry | None = None,
        on_redis_written: Callable[[Sequence[EnrichmentResult]], None] | None = None,
    ) -> None:
        self.redis = redis
        self.s3 = s3
        self.retry = retry or SinkRetry()
        self.retries = 0
        self.idle_flush_s = idle_flush_s
        self.max_batch = max_batch
        self.on_redis_written = on_redis_written
        self._incoming: list[tuple[EnrichmentResult, asyncio.Future[None]]] = []
        self._awaiting_s3: list[asyncio.Future[None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_arrival = time.monotonic()
        self.redis_batches = 0
        self.s3_flushes = 0
        self.error: BaseException | None = None
        """The write failure that stopped this committer; every later ``submit`` raises it."""

    async def submit(self, result: EnrichmentResult) -> None:
        """Returns once ``result`` is in Redis and in a flushed S3 object; raises if a write failed."""
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
            while True:
                if not self._incoming:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=self.idle_flush_s)
                if self._incoming:
                    await self._write_batch()
                idle = time.monotonic() - self._last_arrival >= self.idle_flush_s
                if self._awaiting_s3 and (idle or self.s3.due()):
                    await with_sink_retry(self.s3.flush, self.retry, what="s3 flush", on_retry=self._retried)
                    self.s3_flushes += 1
                    waiting, self._awaiting_s3 = self._awaiting_s3, []
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
            await with_sink_retry(
                lambda: self.redis.write(results), self.retry, what="redis write", on_retry=self._retried
            )
            if self.on_redis_written is not None:
                self.on_redis_written(results)
            await self.s3.write(results)  # buffers; never fails (see S3InsightSink.write)
        except BaseException:
            self._incoming[:0] = batch
            raise
        self.redis_batches += 1
        self._awaiting_s3.extend(future for _, future in batch)

    def _retried(self, what: str, exc: BaseException) -> None:
        self.retries += 1

    def _fail(self, exc: BaseException) -> None:
        for future in [*self._awaiting_s3, *(f for _, f in self._incoming)]:
            if not future.done():
                future.set_exception(exc)
        self._awaiting_s3, self._incoming = [], []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.s3.close()
        await self.redis.close()
