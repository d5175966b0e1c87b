"""Progress made durable: the committer, the durable point, and offset commits.

The one commit path (``commit_durable``): take the completed prefix of the epoch log, make it durable
(``pipeline.checkpoint.Checkpoint.make_durable``: flush every sink, deliver the dead letters, then save
the epochs' session deltas), then commit its offsets. Epochs become durable in the order they were
opened, so a crash replays from a point whose effects are all stored. Eviction of idle sessions runs
here, after a save, since only then is a session's delta no longer needed in memory.

Only for partitions still owned: a durable point can wait on a store (under ``sink_retry``) for longer
than a revoke waits for it (``revoke_timeout_s``). Its sessions are saved and its offsets committed
only while the lease its epochs were opened under is current (``runner.assignment``); otherwise both
are dropped, and the partitions' next owner replays them. A save already sent when the lease ends can
still reach Redis after the next owner has loaded; the store refuses it there, by the partitions'
fencing tokens (``runner.ownership``), and the durable point is dropped the same way. The commit runs
inside the durable point's lock, so a later durable point (the revoke's) can never commit before an
earlier one and move the group's offsets backwards.

While a revoke hands over, no periodic durable point starts (its commit, made from another thread,
librdkafka would hold until the revoke callback returns); the revoke's own is the one. One already
under way when the revoke begins leaves its offsets to the hand-over (``_handed``), which commits them
with its own on the consumer thread, where librdkafka takes them: committed from the loop's thread
they were held until the callback returned, so the hand-over waited ``commit_wait_s`` for them and then
committed nothing, and the next owner replayed them. With stores tens of milliseconds away a durable
point spans much of each second, and so many revokes met one. Only a commit already sent when the
revoke begins is still held; past ``commit_wait_s`` of it the revoke's durable point makes nothing
durable and commits nothing (``durable_point``). That commit
completes after the callback; the epochs after it are forgotten with the assignment and replayed by
the next owner, whose replayed prompts the answer ledger answers without a new call.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from runner.epochs import merged_offsets
from runner.errors import OwnershipLost
from runner.session_store import SessionsFenced

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner

LOCK_CHECK_S = 0.05
"""How often the revoke's durable point, waiting for the one under way, checks that one's commit."""


class Committer:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self._lock = asyncio.Lock()
        self._commit_started: float | None = None
        """When the offset commit of the durable point under way began (monotonic), retries included."""
        self._handed: tuple[int, list[TopicPartition]] | None = None
        """Offsets a durable point made durable as a revoke began, and the lease they belong to: the
        hand-over commits them (``durable_point``)."""

    @property
    def busy(self) -> bool:
        """A durable point is under way."""
        return self._lock.locked()

    @property
    def commit_under_way_s(self) -> float:
        """How long the offset commit of the durable point under way has taken so far (0.0: none is
        under way). Read by the revoke on the consumer thread too."""
        started = self._commit_started
        return 0.0 if started is None else time.monotonic() - started

    async def run(self) -> None:
        """Every ``commit_interval_s``; a failure (a store down past ``sink_retry``) fails the runner."""
        runner = self.runner
        while True:
            await asyncio.sleep(runner.settings.commit_interval_s)
            if runner.handover.revoking:  # its hand-over makes the durable point
                continue
            try:
                await self.commit_durable()
            except Exception as exc:
                runner.fail(exc)
                return

    async def commit_durable(self) -> None:
        """The one commit path: make the completed prefix durable, then commit its offsets."""
        async with self._lock:
            generation = self.runner.assignment.generation
            lease, offsets = await self._durable_point()
            # A revoke has begun: the loop hears of it a turn after the consumer thread counts it.
            revoking = self.runner.handover.revoking or self.runner.assignment.generation != generation
            if offsets and revoking:
                self._handed = (lease, offsets)  # the hand-over's commit, on the consumer thread
                return
            if offsets:
                log = self.runner.log
                self._commit_started = time.monotonic()
                try:
                    await self.runner.checkpoint.commit(
                        functools.partial(self.commit_offsets, offsets, lease),
                        on_fenced=lambda exc: log(f"commit skipped, the group is rebalancing: {exc}"),
                    )
                finally:
                    self._commit_started = None
            elif not self.runner.epochs:
                # Nothing read since the last commit, and nothing waiting (an idle partition, or fired
                # timers, whose epochs carry no offsets, all saved): up to date, as after a commit.
                # Left alone, the age grew on a healthy idle runner and set off the alert for a
                # runner that makes nothing durable.
                self.runner.stats.last_commit_at = time.monotonic()

    def commit_offsets(self, offsets: list[TopicPartition], lease: int) -> None:
        """Blocking: call off the loop, or on the consumer thread. Commits nothing once ``lease`` has
        ended (the partitions were handed over meanwhile)."""
        runner = self.runner
        with runner.assignment.holding(lease) as current:
            if not current:
                runner.log(
                    "commit dropped: its partitions were handed over meanwhile (the next owner replays)"
                )
                return
            runner.consumer.commit(offsets=offsets, asynchronous=False)
        runner.stats.commits += 1
        runner.stats.last_commit_at = time.monotonic()

    async def durable_point(self, commit_wait_s: float = math.inf) -> tuple[int, list[TopicPartition]]:
        """For the revoke's hand-over: ``_durable_point`` under the lock (the caller commits), after the
        durable point under way. Not after one whose offset commit has been under way for longer than
        ``commit_wait_s``: librdkafka can hold that commit until the revoke callback returns, which
        waits for this. Then nothing is made durable here and nothing is to be committed (the lease,
        no offsets); the lock is never passed over, so no later offsets can land before that commit's."""
        while True:
            try:
                async with asyncio.timeout(LOCK_CHECK_S):
                    await self._lock.acquire()
                break
            except TimeoutError:
                if self.commit_under_way_s > commit_wait_s:
                    self.runner.log(
                        f"rebalance: an offset commit under way for {self.commit_under_way_s:.1f} s; the "
                        "hand-over commits nothing of its own (that commit completes after the revoke, "
                        "the next owner replays what came after it)"
                    )
                    return self.runner.assignment.lease, []
        try:
            lease, offsets = await self._durable_point()
            return lease, self._with_handed(lease, offsets)
        finally:
            self._lock.release()

    def _with_handed(self, lease: int, offsets: list[TopicPartition]) -> list[TopicPartition]:
        """``offsets`` and those a durable point left to the hand-over under the same ``lease``: per
        partition the later one (epochs become durable in order, so it is the larger)."""
        handed, self._handed = self._handed, None
        if handed is None or handed[0] != lease:
            return offsets
        merged = {(tp.topic, tp.partition): tp.offset for tp in handed[1]}
        for tp in offsets:
            merged[tp.topic, tp.partition] = max(tp.offset, merged.get((tp.topic, tp.partition), tp.offset))
        return [TopicPartition(topic, partition, offset) for (topic, partition), offset in merged.items()]

    async def _durable_point(self) -> tuple[int, list[TopicPartition]]:
        """Make every completed epoch (in order, up to the first incomplete one) durable and return
        the lease they belong to and the offsets that may now be committed under it: the checkpoint
        flushes the sinks, delivers the dead letters, then saves the epochs' session deltas. Epochs of
        an ended lease are dropped; a save is skipped once the lease ends during the flush."""
        runner = self.runner
        lease = runner.assignment.lease
        ready = [epoch for epoch in runner.epochs.take_completed_prefix() if epoch.lease == lease]
        if not ready:
            return lease, []
        deltas = [d for epoch in ready for d in epoch.deltas]
        fenced: list[SessionsFenced] = []
        save_id = uuid.uuid4().hex  # one for every try of this save: a retry applies it at most once

        async def save() -> int:
            if runner.assignment.lease != lease:  # handed over while the sinks flushed
                return 0
            try:
                return await runner.store.save(deltas, runner.ownership.tokens(lease), save_id)
            except SessionsFenced as refused:  # a newer owner holds them: not a store failure to retry
                fenced.append(refused)
                return 0

        await runner.checkpoint.make_durable(save_state=save)
        runner.sessions.evict(runner.epochs.shoppers_in_flight())
        if fenced:
            runner.stats.fenced_saves += 1
            if runner.assignment.lease == lease:  # no hand-over explains it: stop, do not drift
                raise OwnershipLost(fenced[0].partitions)
            runner.log(f"durable point dropped: {fenced[0]} (the next owner replays)")
            return lease, []
        if runner.assignment.lease != lease:
            runner.log(
                "durable point dropped: its partitions were handed over meanwhile (the next owner replays)"
            )
            return lease, []
        return lease, [TopicPartition(t, p, o) for (t, p), o in merged_offsets(ready).items()]
