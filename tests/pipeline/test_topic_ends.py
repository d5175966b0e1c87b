"""Where a partition ends, against the real broker: records produced as one large batch (what a
backfill or the fault suite's producer does) must count in full, whatever the broker's ListOffsets
says (``pipeline.topic_ends``: Tansu answers it per batch, which once ended a drained run early)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from devstack.stack import StackState
from pipeline.topic_ends import end_offset, topic_lag
from shopper.readback import read_dlq
from tests.conftest import Isolated

RECORDS = 300


@pytest.fixture
def batched_topic(stack: StackState) -> Iterator[Isolated]:
    """A one-partition topic holding ``RECORDS`` records produced as one batch (and its DLQ topic,
    holding the same records, for the reader)."""
    names = Isolated(stack)
    names.create_topics(partitions=1)
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 200})
    for i in range(RECORDS):
        producer.produce(names.topic, key=b"shopper", value=b'{"n": %d}' % i)
        producer.produce(names.dlq_topic, value=b'{"n": %d}' % i)
    assert producer.flush(30) == 0
    yield names
    names.cleanup()


def consumer_of(stack: StackState, group: str) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": stack.kafka_bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )


def test_a_consumer_part_way_through_a_batch_is_not_drained(
    stack: StackState, batched_topic: Isolated
) -> None:
    partition = TopicPartition(batched_topic.topic, 0, 0)
    consumer = consumer_of(stack, batched_topic.group)
    try:
        consumer.assign([partition])
        seen: list[int] = []
        while len(seen) < 10:
            for message in consumer.consume(10 - len(seen), 5.0):
                assert message.error() is None
                seen.append(message.offset() or 0)
        position = consumer.position([partition])[0].offset
        assert position == 10
        assert end_offset(consumer, partition) == RECORDS
        assert topic_lag(consumer, batched_topic.topic, [partition]) == RECORDS - position
    finally:
        consumer.close()


def test_an_own_partition_not_yet_read_is_never_done(stack: StackState, batched_topic: Isolated) -> None:
    partition = TopicPartition(batched_topic.topic, 0)
    fresh = consumer_of(stack, batched_topic.group)
    try:
        fresh.assign([partition])  # assigned, nothing consumed yet: no position, whatever was fetched
        assert topic_lag(fresh, batched_topic.topic, [partition]) > 0
    finally:
        fresh.close()


def test_the_dead_letter_reader_reads_a_batched_topic_to_its_end(
    batched_topic: Isolated, stack: StackState
) -> None:
    records = read_dlq(stack.kafka_bootstrap, batched_topic.dlq_topic)
    assert [r["n"] for r in records] == list(range(RECORDS))


def test_an_own_partition_already_done_by_the_group_is_done_once_fetched(
    stack: StackState, batched_topic: Isolated
) -> None:
    """A member handed a partition that an earlier member finished and committed (a rebalance after the
    other worker drained) gets no records from it, so it never has a position there: counted from 0,
    an until-drained runner waited for good (the two-worker test hung about one run in three)."""
    partition = TopicPartition(batched_topic.topic, 0)
    first = consumer_of(stack, batched_topic.group)
    try:
        first.assign([TopicPartition(batched_topic.topic, 0, 0)])
        seen = 0
        while seen < RECORDS:
            seen += len([m for m in first.consume(RECORDS, 5.0) if m.error() is None])
        first.commit(offsets=[TopicPartition(batched_topic.topic, 0, RECORDS)], asynchronous=False)
    finally:
        first.close()
    second = consumer_of(stack, batched_topic.group)
    try:
        second.assign([partition])
        for _ in range(10):  # fetches from the committed offset: an empty answer, with the end in it
            assert not [m for m in second.consume(10, 0.5) if m.error() is None]
            if second.get_watermark_offsets(partition, cached=True)[1] >= 0:
                break
        assert second.position([partition])[0].offset < 0, "no record, so no position"
        assert topic_lag(second, batched_topic.topic, [partition]) == 0
    finally:
        second.close()
