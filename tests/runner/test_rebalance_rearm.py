"""Re-arming timers after an assignment, against the real broker and Redis.

On an assignment the runner loads the pending triggers of its new partitions from Redis. That load
used to run as a future nobody kept: its failure vanished (the runner went on without those timers),
and a load that finished after the partitions were revoked armed timers and cached sessions for
partitions another member owned by then (whose timers this member would fire, and whose sessions it
would save). Now a failed re-arm fails the runner, and a re-arm overtaken by a revoke arms nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
import redis.exceptions
from confluent_kafka import Consumer, TopicPartition

from devstack.synthetic import SyntheticStream
from pipeline.sink_retry import SinkRetry
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.session import ShopperSession
from runner.embedded import EmbeddedRunner
from runner.epochs import Epoch
from runner.session_store import RedisSessionStore, SessionDelta
from sinks.keys import RedisKeys
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis
from tests.helpers import broker_connections, broker_connections_left
from tests.prompt_assembly.test_sessions import event
from tests.runner.kit import running

pytestmark = pytest.mark.slow

PARTITIONS = 4


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_rearm_that_fails_fails_the_runner(isolated: Isolated) -> None:
    """Partition 0's timer set is not a sorted set (a foreign writer, a bad migration): loading it
    fails on every retry. The runner must stop with that error, not drain and exit 0 without the
    partition's timers."""
    client = sync_redis.Redis.from_url(isolated.stack.redis_url)
    client.set(RedisKeys(isolated.prefix).timers(0), b"not a sorted set")
    client.close()
    lines: list[str] = []
    settings = isolated.runner(sink_retry=SinkRetry(max_wait_s=0.5), drain_idle_s=5.0)
    runner = EmbeddedRunner(settings, log=lines.append)
    bootstrap = isolated.stack.kafka_bootstrap
    before = broker_connections(bootstrap)

    async def bounded() -> None:
        async with asyncio.timeout(60):
            await runner.run()

    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):  # held, with its traceback
        asyncio.run(bounded())
    assert any("re-arming the timers of partitions" in line for line in lines), lines[-5:]
    assert runner.stats.commits == 0
    # Its producers closed, not only dropped: the error holds ``run``'s frame, and they were in it.
    left = broker_connections_left(bootstrap, before)
    assert left <= 0, f"{left} broker connections left open by the failed run"


def seed_pending_sessions(redis_url: str, prefix: str, deadline: float | None = None) -> dict[str, int]:
    """Sessions with a pending trigger in every partition, saved with their timers as a previous
    owner would have (``deadline``, by default far ahead: nothing fires during the test). Returns
    shopper -> partition."""
    processor = SessionProcessor()
    sessions: dict[str, ShopperSession] = {}
    for _, value, _ in SyntheticStream(shoppers=24, seed=17).take(200):
        event = parse_event(value)
        session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
        processor.apply(session, event, value)
    pending = sorted(sid for sid, session in sessions.items() if session.pending is not None)
    partition_of = {sid: i % PARTITIONS for i, sid in enumerate(pending)}
    assert len(pending) >= 2 * PARTITIONS

    async def save() -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = RedisSessionStore(client, prefix)
        wall = time.time() + 1e6 if deadline is None else deadline
        deltas = [SessionDelta(sid, p, sessions[sid].take_changes(), wall) for sid, p in partition_of.items()]
        await store.save(deltas, {p: await store.take_ownership(p) for p in range(PARTITIONS)})
        await client.aclose()

    asyncio.run(save())
    return partition_of


class GroupMember:
    """A second member of the runner's consumer group, polling on a thread of its own."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.assigned: list[int] = []
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
            }
        )
        self._consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _on_assign(self, _: Consumer, partitions: list[TopicPartition]) -> None:
        self.assigned = sorted(tp.partition for tp in partitions)

    def _on_revoke(self, _: Consumer, partitions: list[TopicPartition]) -> None:
        self.assigned = []

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._consumer.poll(0.1)
        self._consumer.close()

    def leave(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_rearm_overtaken_by_a_revoke_arms_nothing_for_the_revoked_partitions(
    isolated: Isolated, tmp_path: Path
) -> None:
    """The runner's Redis is frozen (SIGSTOP) while it is assigned all four partitions, so their
    re-arm hangs; a second member joins and takes two of them; then Redis goes on. Every timer armed
    and every session held must belong to a partition the runner owns now."""
    own = OwnRedis(tmp_path)
    own.start()
    assert own.process is not None
    redis_pid = own.process.pid
    frozen = False
    try:
        partition_of = seed_pending_sessions(own.url, isolated.prefix)
        sinks = isolated.sinks().model_copy(update={"redis_url": own.url})
        runner = EmbeddedRunner(isolated.runner(until_drained=False, sinks=sinks), log=lambda _: None)

        async def scenario() -> tuple[set[int], dict[str, int], set[str]]:
            nonlocal frozen
            os.kill(redis_pid, signal.SIGSTOP)
            frozen = True
            task = asyncio.create_task(runner.run())
            other: GroupMember | None = None
            try:
                await wait_for(lambda: runner.assigned_partitions() == list(range(PARTITIONS)), "assign")
                other = member = GroupMember(isolated.stack.kafka_bootstrap, isolated.group, isolated.topic)
                await wait_for(
                    lambda: len(runner.assigned_partitions()) == 2 and len(member.assigned) == 2,
                    "the rebalance to two members",
                )
                os.kill(redis_pid, signal.SIGCONT)
                frozen = False
                owned = set(runner.assigned_partitions())
                mine = {sid for sid, p in partition_of.items() if p in owned}
                await wait_for(
                    lambda: mine <= set(runner.sessions.partition_map), "the re-arm of owned partitions"
                )
                await asyncio.sleep(1.0)  # time for a stale re-arm (all four partitions) to land
                assert not task.done()
                return owned, dict(runner.sessions.partition_map), set(runner.sessions)
            finally:
                if frozen:
                    os.kill(redis_pid, signal.SIGCONT)
                    frozen = False
                runner.request_stop()
                await task
                if other is not None:
                    await asyncio.to_thread(other.leave)

        owned, armed, held = asyncio.run(scenario())
    finally:
        if frozen:
            os.kill(redis_pid, signal.SIGCONT)
        own.stop()

    assert {partition_of[sid] for sid in armed} == owned, f"timers armed for {armed}, owning {owned}"
    assert {armed[sid] for sid in armed} == owned
    assert {partition_of[sid] for sid in held} <= owned, "sessions held for partitions owned elsewhere"


def test_a_restored_timer_waits_its_own_quiet_period_from_the_restart(isolated: Isolated) -> None:
    """Stored timers whose deadlines passed while no runner owned their partitions (a crash, a slow
    handover) are re-armed no earlier than their own wait from the re-arm, as the Flink job does: the
    replay from the committed offsets first brings the shoppers' newer events, which move or clear
    the triggers as they did before. Fired at once, such a timer prompted for a session as the save
    left it (a pause an event had cleared since: an extra prompt a clean run never made)."""
    passed = time.time() - 600
    partition_of = seed_pending_sessions(isolated.stack.redis_url, isolated.prefix, deadline=passed)
    settings = isolated.runner(until_drained=False)
    runner = EmbeddedRunner(settings, log=lambda _: None)

    async def scenario() -> tuple[float, dict[str, float], dict[str, float]]:
        started = time.time()
        async with running(runner):
            await wait_for(lambda: set(partition_of) <= set(runner.sessions.partition_map), "the re-arm")
            waits = {}
            for sid in partition_of:
                session = runner.sessions[sid]
                assert session.pending is not None, f"{sid}'s trigger fired at once"
                quiet_s = session.pending.due_ts - session.last_event_ts
                waits[sid] = quiet_s * settings.timer_wall_per_event_s
            return started, waits, runner.timers.deadlines()

    started, waits, deadlines = asyncio.run(scenario())
    assert set(deadlines) == set(partition_of)
    for sid, wait in waits.items():
        assert deadlines[sid] >= started + wait, (sid, deadlines[sid] - started, wait)


def test_a_rearm_leaves_a_trigger_that_ingest_armed_first_to_its_own_deadline(isolated: Isolated) -> None:
    """Ingest can load a shopper of a newly assigned partition, apply a newer event and arm that
    event's pause before the re-arm reaches the partition (it loads one partition after another).
    The stored deadline belongs to the older pause: armed with the newer pause's due time, it fired
    that pause before its quiet period had passed, a prompt the clean run never made. The re-arm now
    arms only the sessions it loaded itself."""
    shopper, partition = "s-rearm-race", 0
    first_ts = time.time() - 60
    settings = isolated.runner(until_drained=False)
    runner = EmbeddedRunner(settings, log=lambda _: None)

    async def scenario() -> tuple[float, dict[str, float]]:
        client = aioredis.Redis.from_url(isolated.stack.redis_url)
        store = RedisSessionStore(client, isolated.prefix)
        try:
            # The previous owner's save: the first view's pause, due on the wall clock in 0.5 s.
            stored = runner.processor.new_session(shopper)
            runner.processor.apply(stored, event("view", first_ts, shopper))
            assert stored.pending is not None
            stored_wall = runner.timers.now() + 0.5
            delta = SessionDelta(shopper, partition, stored.take_changes(), stored_wall)
            await store.save([delta], {partition: await store.take_ownership(partition)})
            runner.store = store
            # Ingest's poll: the shopper loaded, a newer view applied, its own pause armed.
            runner.sessions.adopt(await store.load_many([shopper]))
            runner.processor.apply(runner.sessions[shopper], event("view", first_ts + 5, shopper))
            runner.sessions.place_many({shopper: partition})
            runner.close_epoch(Epoch(lease=runner.assignment.lease), {shopper})
            own = runner.timers.deadlines()[shopper]
            assert own > stored_wall
            await runner.handover._rearm(runner.assignment.generation, [partition])
            return own, runner.timers.deadlines()
        finally:
            await client.aclose()

    own, deadlines = asyncio.run(scenario())
    assert deadlines == {shopper: own}, f"the stored deadline armed for the newer pause: {deadlines}"
