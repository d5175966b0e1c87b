"""A synchronous offset commit under way on another thread while the revoke callback ends the lease.

librdkafka holds such a commit until the rebalance moves on, and the rebalance waits for the revoke
callback. The callback used to wait for the commit without a bound (``Assignment.end_lease``), so the
consumer thread and the committer waited on each other for ever: a broker restart mid-stream hung the
fault suite that way in CI. Here the same two threads, on a real broker and consumer group: the
committer commits inside ``holding``; a second member joins; the first member's revoke callback ends
the lease. The callback returns within its bound, and the commit completes after it.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from runner.assignment import Assignment
from runner.handover import COMMIT_UNDER_WAY_WAIT_S
from tests.conftest import Isolated
from tests.helpers import produce_records
from tests.runner.kit import cart_add

pytestmark = pytest.mark.slow


def member(isolated: Isolated) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": isolated.stack.kafka_bootstrap,
            "group.id": isolated.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )


def test_a_revoke_does_not_wait_for_ever_on_a_commit_that_waits_for_the_revoke(isolated: Isolated) -> None:
    produce_records(
        isolated.stack.kafka_bootstrap, isolated.topic, [cart_add(f"s{i}", time.time()) for i in range(40)]
    )
    assignment = Assignment()
    events: list[str] = []
    commit_under_way = threading.Event()
    committers: list[threading.Thread] = []
    commit_errors: list[BaseException] = []

    def commit(consumer: Consumer, offsets: list[TopicPartition], lease: int) -> None:
        with assignment.holding(lease) as current:
            assert current
            commit_under_way.set()
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except BaseException as exc:  # reported by the test thread
                commit_errors.append(exc)
        events.append("commit done")

    first = member(isolated)
    consumed: list[TopicPartition] = []

    def on_revoke(consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not consumed or committers:
            return
        offsets = [TopicPartition(tp.topic, tp.partition, tp.offset + 1) for tp in consumed]
        committer = threading.Thread(target=commit, args=(consumer, offsets, assignment.lease))
        committers.append(committer)
        committer.start()
        commit_under_way.wait(10)
        events.append(
            "lease ended"
            if assignment.end_lease(COMMIT_UNDER_WAY_WAIT_S)
            else "lease ended, commit under way"
        )

    first.subscribe([isolated.topic], on_revoke=on_revoke)
    second = member(isolated)
    done = threading.Event()

    def run_group() -> None:
        deadline = time.monotonic() + 120
        while not consumed and time.monotonic() < deadline:
            message = first.poll(0.5)
            if message is not None and message.error() is None:
                topic, partition, offset = message.topic(), message.partition(), message.offset()
                assert topic is not None and partition is not None and offset is not None
                consumed.append(TopicPartition(topic, partition, offset))
        second.subscribe([isolated.topic])
        while not any(e.startswith("lease ended") for e in events) and time.monotonic() < deadline:
            first.poll(0.2)
            second.poll(0.2)
        done.set()

    group = threading.Thread(target=run_group, daemon=True)  # a deadlock leaves it behind, not the suite
    group.start()
    try:
        assert done.wait(180), f"the revoke callback never returned: {events}"
        assert consumed, "the first member consumed nothing"
        assert committers, "the first member was never revoked"
        # The callback returned; the rebalance moves on and with it the commit.
        deadline = time.monotonic() + 120
        while committers[0].is_alive() and time.monotonic() < deadline:
            first.poll(0.2)
            second.poll(0.2)
        assert not committers[0].is_alive(), f"the commit never completed: {events}"
        assert assignment.lease == 1
        assert sorted(events) == ["commit done", "lease ended, commit under way"] or events == [
            "commit done",
            "lease ended",
        ], events
        assert not commit_errors or all(
            "REBALANCE" in repr(e) or "GENERATION" in repr(e) for e in commit_errors
        )
    finally:
        if not group.is_alive():
            first.close()
            second.close()
