"""The commit protocol of both engines, in one object: results to every sink; at a durable point, flush
every sink, then deliver the dead letters, then save the engine's state, then commit offsets.

The order is what makes at-least-once hold: offsets are committed only once everything the records
before them caused is stored, so a crash anywhere replays from a point whose effects are all durable
(and every sink is idempotent, so a replay stores nothing twice where readers cannot dedupe it). A
store that is down is waited for under ``SinkRetry``, never committed past.

- The embedded runner drives all four steps (``runner.embedded``).
- The Flink job's async sink stage (``pipeline.sink_commit.SinkCommitter``) calls ``write`` and
  ``make_durable`` (sinks only) before a call completes; Flink does the rest in the same order, because
  its checkpoint barrier passes only after the async stage drains, then the dead-letter ``KafkaSink``
  flushes, then the source offsets are stored in the checkpoint.

Modelled on quix-streams' ``Checkpoint.commit()`` (sinks, then changelogs, then the producer, then
offsets).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from pipeline.offset_commits import commit_waiting_for_broker
from pipeline.sink_retry import SinkRetry, with_sink_retry
from prompt_assembly.records import EnrichmentResult
from sinks.base import ResultSink
from sinks.kafka import KafkaResultSink
from sinks.redis import RedisSignalSink

RetryHook = Callable[[str, BaseException], None]


class DeadLetterQueue(Protocol):
    async def deliver(self) -> None:
        """Returns once every dead letter queued so far has its delivery report; raises when that
        takes longer than the engine's bound (nothing past them may be committed)."""
        ...


class Checkpoint:
    def __init__(
        self,
        sinks: Sequence[ResultSink],
        retry: SinkRetry,
        *,
        dead_letters: DeadLetterQueue | None = None,
        on_retry: RetryHook | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.retry = retry
        self.dead_letters = dead_letters
        self.on_retry = on_retry
        self.durable_points = 0
        self.commits = 0

    async def _retrying(self, write: Callable[[], Awaitable[None]], what: str) -> None:
        await with_sink_retry(write, self.retry, what=what, on_retry=self.on_retry)

    async def open(self) -> None:
        for sink in self.sinks:
            await self._retrying(sink.open, f"{sink.name} open")

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        """``results`` to every sink in order, each write retried (sinks are idempotent)."""
        for sink in self.sinks:
            await self._retrying(functools.partial(sink.write, results), f"{sink.name} write")

    @property
    def session_resets(self) -> int:
        """Answers that replaced another session's signal (the shopper's session state was lost while
        their signal lived), as the Redis sink counted them: both engines export it."""
        return sum(sink.session_resets for sink in self.sinks if isinstance(sink, RedisSignalSink))

    @property
    def results_too_large(self) -> int:
        """Results the Kafka sink could not write, over a size limit (``sinks.errors.ResultTooLarge``):
        missing from the results topic only (Redis and S3 hold them), so both engines export the count."""
        return sum(sink.too_large for sink in self.sinks if isinstance(sink, KafkaResultSink))

    def due(self) -> bool:
        """A sink asks to be flushed before the next durable point (size or age)."""
        return any(sink.due() for sink in self.sinks)

    async def make_durable(self, save_state: Callable[[], Awaitable[object]] | None = None) -> None:
        """Flush every sink, then deliver the dead letters, then ``save_state`` (the runner's session
        deltas), each waited for under the retry policy. Offsets may be committed after this."""
        for sink in self.sinks:
            await self._retrying(sink.flush, f"{sink.name} flush")
        if self.dead_letters is not None:
            await self.dead_letters.deliver()
        if save_state is not None:
            await with_sink_retry(save_state, self.retry, what="state save", on_retry=self.on_retry)
        self.durable_points += 1

    async def commit(
        self, commit_offsets: Callable[[], None], *, on_fenced: Callable[[BaseException], None] | None = None
    ) -> bool:
        """The blocking ``commit_offsets()`` off the loop, transient broker errors waited out under the
        retry policy (``pipeline.offset_commits``). False: the group fenced this member; the next owner
        replays from the last commit."""
        committed = await commit_waiting_for_broker(
            commit_offsets, self.retry, on_retry=self.on_retry, on_fenced=on_fenced
        )
        self.commits += committed
        return committed

    async def close(self) -> None:
        """Close every sink (a buffering sink flushes what it can); one failing does not keep the others
        open. Call after the last durable point: what ``close`` flushes is beyond a commit."""
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                await sink.close()
