"""A partition paused by backpressure when it is revoked must not come back paused: librdkafka keeps a
partition's pause across a rebalance, and the runner, which believes itself unpaused after a revoke,
would never resume it (the broker-restart fault case hung that way now and then)."""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import Consumer, Producer, TopicPartition

from devstack.stack import StackState
from pipeline.topic_ends import end_offset
from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated


def at_the_end(consumer: Consumer) -> bool:
    """Every assigned partition read to its high watermark."""
    positions = consumer.position(consumer.assignment())
    return bool(positions) and all(tp.offset == end_offset(consumer, tp) for tp in positions)


def test_a_partition_paused_when_revoked_is_fetched_again_once_reassigned(
    stack: StackState, isolated: Isolated
) -> None:
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    for i in range(20):
        producer.produce(isolated.topic, key=f"s{i}".encode(), value=b"{}")
    assert producer.flush(10) == 0
    runner = EmbeddedRunner(isolated.runner(), log=lambda line: None)
    runner.loop = loop = asyncio.new_event_loop()  # the callback schedules its re-arm there; never run here
    assignments: list[list[TopicPartition]] = []

    def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
        assignments.append(list(partitions))
        runner.handover.on_assign(consumer, partitions)

    def member() -> Consumer:
        return Consumer(
            {
                "bootstrap.servers": stack.kafka_bootstrap,
                "group.id": isolated.group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
            }
        )

    def poll_until(consumers: list[Consumer], done: int) -> None:
        deadline = time.monotonic() + 60
        while len(assignments) < done:
            assert time.monotonic() < deadline, f"no assignment {done}: {assignments}"
            for c in consumers:
                c.poll(0.2)

    first = member()
    try:
        first.subscribe([isolated.topic], on_assign=on_assign)
        poll_until([first], 1)
        first.pause(first.assignment())  # backpressure, as the runner does it
        second = member()  # a rebalance: a member joins, then leaves
        second.subscribe([isolated.topic])
        poll_until([first, second], 2)
        second.close()
        poll_until([first], 3)
        got = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not at_the_end(first):
            got += sum(m.error() is None for m in first.consume(20, 0.5))
        assert got > 0 and at_the_end(first), f"{got} records fetched after the re-assignment"
    finally:
        first.close()
        loop.close()
