"""Progress made durable: the committer, the durable point, and offset commits.

The one commit path (``commit_durable``): take the completed prefix of the epoch log, make it durable
(``pipeline.checkpoint.Checkpoint.make_durable``: flush every sink, deliver the dead letters, then save
the epochs' session deltas), then commit its offsets. Epochs become durable in the order they were
opened, so a crash replays from a point whose effects are all stored. Eviction of idle sessions runs
here, after a save, since only then is a session's delta no longer needed in memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from runner.epochs import merged_offsets

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner


class Committer:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """A durable point is under way."""
        return self._lock.locked()

    async def run(self) -> None:
        """Every ``commit_interval_s``; a failure (a store down past ``sink_retry``) fails the runner."""
        runner = self.runner
        while True:
            await asyncio.sleep(runner.settings.commit_interval_s)
            try:
                await self.commit_durable()
            except Exception as exc:
                runner.fail(exc)
                return

    async def commit_durable(self) -> None:
        """The one commit path: make the completed prefix durable, then commit its offsets."""
        offsets = await self.durable_point()
        if offsets:
            await self.runner.checkpoint.commit(
                functools.partial(self.commit_offsets, offsets),
                on_fenced=lambda exc: self.runner.log(f"commit skipped, the group is rebalancing: {exc}"),
            )

    def commit_offsets(self, offsets: list[TopicPartition]) -> None:
        """Blocking: call off the loop, or on the consumer thread."""
        runner = self.runner
        runner.consumer.commit(offsets=offsets, asynchronous=False)
        runner.stats.commits += 1
        runner.stats.last_commit_at = time.monotonic()

    async def durable_point(self) -> list[TopicPartition]:
        """Make every completed epoch (in order, up to the first incomplete one) durable and return
        the offsets that may now be committed: the checkpoint flushes the sinks, delivers the dead
        letters, then saves the epochs' session deltas."""
        runner = self.runner
        async with self._lock:
            ready = runner.epochs.take_completed_prefix()
            if not ready:
                return []
            deltas = [d for epoch in ready for d in epoch.deltas]
            deadlines = {}
            for delta in deltas:
                session = runner.sessions.get(delta.shopper_id)
                if session is not None and session.pending is not None:
                    deadlines[delta.shopper_id] = runner.triggers.wall_deadline(session)
            await runner.checkpoint.make_durable(save_state=lambda: runner.store.save(deltas, deadlines))
            runner.sessions.evict(runner.epochs.shoppers_in_flight())
            return [TopicPartition(t, p, o) for (t, p), o in merged_offsets(ready).items()]
