"""Rebalance hand-over: what the runner does when the group gives it partitions or takes them away.

- **Assign** (``on_assign``): a new assignment starts unpaused, and the pending triggers the store
  holds for the assigned partitions are re-armed (``rearm``), never for a partition revoked meanwhile.
- **Revoke** (``on_revoke``): the partitions are handed over durable and committed, waiting at most
  ``revoke_timeout_s`` (past it they go over uncommitted and the next owner replays them); then every
  session, timer and epoch of the old assignment is forgotten.

While a revoke hands over (``revoking``; the consumer thread is in the callback and, with the eager
protocol, the whole group waits for it) nothing new starts on the loop that it would have to wait for:
no timer fires (``TriggerLoop.run``): a prompt fired then opened an epoch that stayed incomplete for an
LLM call, and under steady load new ones kept coming, so the hand-over waited out ``revoke_timeout_s``
and went over uncommitted. A trigger not fired stays pending in its session, which the hand-over's
durable point saves with its deadline, and the partition's next owner re-arms it (``_rearm``). No
periodic durable point starts either (``Committer.run``): librdkafka holds an offset commit made from
another thread until the callback returns, so it could only delay this one; one already under way
leaves its offsets to this hand-over's commit (``Committer``). A commit already sent is waited for
``COMMIT_UNDER_WAY_WAIT_S`` in all (``Committer.durable_point``, ``Assignment.end_lease``).

``on_assign`` and ``on_revoke`` run on the consumer thread, inside ``consume``; everything they change
that the loop also uses is changed on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, KafkaException, TopicPartition

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner

COMMIT_UNDER_WAY_WAIT_S = 2.0
"""How long a revoke waits for an offset commit already under way, in all, before handing over without
it: one already sent to a live coordinator takes milliseconds; one librdkafka deferred waits for this
callback."""


REARM_CONCURRENCY = 8
"""Partitions whose pending triggers are re-armed at once after an assignment (each one's loads stay
bounded by its own timers)."""


class RebalanceHandover:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self._rearms: set[asyncio.Task[None]] = set()
        self._settled = asyncio.Event()
        """Set while no revoke hands over; cleared and set on the loop, in the callback's order."""
        self._settled.set()

    @property
    def rearming(self) -> bool:
        """A re-arm of an assignment's timers is still loading them."""
        return bool(self._rearms)

    @property
    def revoking(self) -> bool:
        """A revoke is handing partitions over (as the loop sees it: from before the hand-over's durable
        point starts until the old assignment is forgotten)."""
        return not self._settled.is_set()

    async def settled(self) -> None:
        """Return once no revoke is handing partitions over (at once when none is)."""
        await self._settled.wait()

    # ---- on the consumer thread ------------------------------------------------------------------
    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """A new assignment starts unpaused. librdkafka keeps a partition's pause across a rebalance:
        one paused by backpressure when it was revoked came back paused while the runner's flag said
        no, so nothing resumed it and the runner fetched nothing from it again (the broker-restart
        fault case hung that way now and then)."""
        runner = self.runner
        # The event topic's partitions: p of the repartition topic comes with them (runner.repartition)
        numbers = sorted(tp.partition for tp in partitions if tp.topic == runner.settings.topic)
        runner.log(f"rebalance: assigned partitions {numbers}")
        consumer.resume(partitions)
        runner.assignment.partitions = list(partitions)
        runner.assignment.generation += 1
        assert runner.loop is not None
        if runner.settings.input == "events":
            # A runner whose input is prompts holds no sessions: the session stage (the Flink job) does.
            # It re-armed the stored timers of its partitions all the same, taking their fencing tokens
            # from an events runner on the same key prefix (which then stopped, fenced) and firing its
            # browse pauses a second time.
            runner.loop.call_soon_threadsafe(self._start_rearm, runner.assignment.generation, numbers)

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Hand the partitions over durable and committed, waiting at most ``revoke_timeout_s``: the
        consumer thread is blocked here, and a member that stalls its group's rebalance stalls the
        group. Past the bound the partitions go over uncommitted; the next owner replays them."""
        runner = self.runner
        loop = runner.loop
        assert loop is not None
        topic = runner.settings.topic
        runner.log(
            f"rebalance: revoking partitions {sorted(tp.partition for tp in partitions if tp.topic == topic)}"
        )
        runner.assignment.generation += 1  # a re-arm still running for these partitions arms nothing more
        # First in the loop's queue: no timer fires and no periodic durable point starts from here on.
        loop.call_soon_threadsafe(self._begin_revoke)
        try:
            self._hand_over_and_forget()
        finally:
            loop.call_soon_threadsafe(self._settled.set)  # after _forget_assignment: its timers are gone

    def _hand_over_and_forget(self) -> None:
        runner = self.runner
        loop = runner.loop
        assert loop is not None
        if runner.assignment and runner.failure is None:
            self._commit_handover(loop)
        # From here no save or commit of the old assignment starts. A commit still under way can be
        # waiting for this rebalance to move on, which waits for this callback: bounded (assignment),
        # by what is left of the wait the durable point may already have spent on it.
        wait_s = max(0.0, COMMIT_UNDER_WAY_WAIT_S - runner.commits.commit_under_way_s)
        if not runner.assignment.end_lease(wait_s=wait_s):
            runner.log(
                f"rebalance: a commit under way did not finish within {COMMIT_UNDER_WAY_WAIT_S} s; "
                "partitions handed over, the commit completes after (its offsets are durable)"
            )
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._forget_assignment(), loop).result(timeout=5)
        runner.assignment.partitions = []
        runner.ingest.paused = False

    def _commit_handover(self, loop: asyncio.AbstractEventLoop) -> None:
        """The revoked partitions' results made durable and committed, if within ``revoke_timeout_s``;
        each outcome logged."""
        runner = self.runner
        timeout = runner.settings.revoke_timeout_s
        started = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(self._handover(), loop)
        try:
            lease, offsets = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            runner.log(
                f"rebalance: results not durable within {timeout} s; "
                "partitions handed over uncommitted (the next owner replays them)"
            )
            return
        except Exception as exc:
            runner.log(f"rebalance: hand-over failed ({exc!r}); partitions handed over uncommitted")
            return
        if not offsets:
            runner.log(
                f"rebalance: partitions handed over in {time.monotonic() - started:.1f} s, nothing to commit"
            )
            return
        try:
            runner.commits.commit_offsets(offsets, lease)
        except KafkaException as exc:  # fenced or broker away: the next owner replays them
            runner.log(f"rebalance: hand-over commit failed ({exc}); the next owner replays")
            return
        runner.log(f"rebalance: partitions handed over committed in {time.monotonic() - started:.1f} s")

    # ---- on the loop -----------------------------------------------------------------------------
    def _begin_revoke(self) -> None:
        self._settled.clear()
        self._cancel_rearms()

    async def _handover(self) -> tuple[int, list[TopicPartition]]:
        """Wait for the prompts in flight (no timer fires meanwhile, so their number only falls), then
        make everything durable; the caller commits."""
        runner = self.runner
        while not runner.epochs.all_complete():
            await asyncio.sleep(0.05)
        return await runner.commits.durable_point(commit_wait_s=COMMIT_UNDER_WAY_WAIT_S)

    async def _forget_assignment(self) -> None:
        """After a hand-over (on the loop, like every other user of this state): the next owner holds
        these shoppers now. Epochs not yet durable are dropped, never committed for partitions this
        member no longer owns; their prompts still finish and write (idempotently)."""
        runner = self.runner
        runner.epochs.clear()
        runner.sessions.clear()
        runner.timers.clear()
        runner.ownership.clear()

    def _start_rearm(self, generation: int, partitions: list[int]) -> None:
        """On the loop, for ``on_assign``: re-arming runs in a task kept here, so that its failure
        fails the runner like any other worker's, and a revoke can cancel it."""
        task = asyncio.create_task(self._rearm(generation, partitions), name=f"rearm {partitions}")
        self._rearms.add(task)
        task.add_done_callback(functools.partial(self._rearm_done, partitions))

    def _rearm_done(self, partitions: list[int], task: asyncio.Task[None]) -> None:
        self._rearms.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.runner.log(f"re-arming the timers of partitions {partitions} failed: {exc!r}")
            self.runner.fail(exc)

    def _cancel_rearms(self) -> None:
        for task in self._rearms:
            task.cancel()

    async def stop(self) -> None:
        """Cancel the re-arms still running (the runner is ending) and wait for them."""
        rearms = list(self._rearms)
        for task in rearms:
            task.cancel()
        for task in rearms:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _rearm(self, generation: int, partitions: list[int]) -> None:
        """Arm the pending triggers the store holds for newly assigned ``partitions``, up to
        ``REARM_CONCURRENCY`` partitions at a time: each takes four round trips to the store one after
        the other, so partition by partition a store 50 ms away armed the last of 48 partitions' pauses
        about 10 s late. Each await can span a rebalance; once the assignment this was started for has
        changed (``generation``), nothing more is armed or cached: the partitions' next owner re-arms
        them, and timers or sessions held here would fire prompts and save sessions for partitions this
        member no longer owns. One partition failing cancels the others (the runner fails)."""
        lease = self.runner.assignment.lease
        room = asyncio.Semaphore(REARM_CONCURRENCY)

        async def rearm(partition: int) -> None:
            async with room:
                await self._rearm_partition(generation, lease, partition)

        try:
            async with asyncio.TaskGroup() as group:
                for partition in partitions:
                    group.create_task(rearm(partition))
        except BaseExceptionGroup as failed:  # the first failure, as the runner reports any other
            raise failed.exceptions[0] from None

    async def _rearm_partition(self, generation: int, lease: int, partition: int) -> None:
        runner = self.runner

        def revoked() -> bool:
            return runner.assignment.generation != generation

        if revoked():
            return
        # The token before any load: a save of the partition's last owner still on its way is
        # refused from here on, so what is loaded below is what that owner left (runner.ownership).
        if not await runner.ownership.ensure([partition], lease):
            return
        timers = await runner.retrying(functools.partial(runner.store.timers, partition), "timer load")
        if revoked():
            return
        sids = runner.sessions.missing(sid for sid, _ in timers)
        loaded = await runner.load_sessions(sids)
        if revoked():
            return
        runner.sessions.adopt(loaded)
        for sid, wall in timers:
            session = runner.sessions.get(sid)
            if session is None or session.pending is None or session is not loaded.get(sid):
                # Not this load's copy: ingest loaded the shopper first (or meanwhile) and
                # applied events, and its ``close_epoch`` armed the trigger pending now. The stored
                # deadline belongs to an older trigger: armed with the newer due time, it fired that
                # pause before its quiet period had passed.
                continue
            runner.sessions.place(sid, partition)
            # A deadline that passed while nobody owned the partition fires no earlier than
            # its own wait from now: the replay from the committed offsets brings the
            # shopper's newer events first, and they move or clear the trigger as they did
            # before the restart (a stale entry is ignored when it pops). Fired at once, it
            # prompted for the session as the save left it: a pause an event had cleared
            # since, or one without the events that came before it fired. A deadline still
            # ahead is kept (a clean handover moves no pause).
            now = runner.timers.now()
            held = wall if wall > now else runner.triggers.wall_deadline(session)
            runner.timers.arm(sid, session.pending.due_ts, held, (session.epoch, session.seq))
