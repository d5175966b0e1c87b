"""The runner places a dead letter on the DLQ partition that Java's default partitioner (murmur2, the
Flink job's Kafka sink) gives its key, so a key's dead letters share a partition whichever engine wrote
them. The runner's DLQ producer used librdkafka's default (CRC32, ``consistent_random``): the same key
went to another partition than on Flink. The oracle is a producer with ``murmur2_random``, which
librdkafka documents as Java's partitioner, writing the same keys to a topic of as many partitions."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.stack import StackState
from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.helpers import produce_records

pytestmark = pytest.mark.slow

DLQ_PARTITIONS = 4
KEYS = [f"shopper-{i}".encode() for i in range(24)]


def placed(bootstrap: str, topic: str, expected: int) -> dict[bytes, int]:
    """Key -> partition of the records in ``topic``."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"read-{topic}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    found: dict[bytes, int] = {}
    try:
        for _ in range(60):
            for message in consumer.consume(100, timeout=0.5):
                if message.error() is None:
                    found[message.key() or b""] = message.partition() or 0
            if len(found) >= expected:
                break
    finally:
        consumer.close()
    return found


def test_a_dead_letter_goes_to_its_keys_partition_under_javas_partitioner(stack: StackState) -> None:
    iso = Isolated(stack)
    oracle_topic = f"oracle-{iso.tag}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(iso.topic, 2, 1),
            NewTopic(iso.dlq_topic, DLQ_PARTITIONS, 1),
            NewTopic(oracle_topic, DLQ_PARTITIONS, 1),
        ]
    )
    for future in futures.values():
        future.result(timeout=10)
    try:
        produce_records(stack.kafka_bootstrap, iso.topic, [(key, b"not json", True) for key in KEYS])
        runner = EmbeddedRunner(iso.runner(), log=lambda _: None)
        stats = asyncio.run(runner.run())
        assert stats.accounting.dead_lettered == len(KEYS)
        java = Producer({"bootstrap.servers": stack.kafka_bootstrap, "partitioner": "murmur2_random"})
        for key in KEYS:
            java.produce(oracle_topic, key=key, value=b"x")
        assert java.flush(30) == 0
        expected = placed(stack.kafka_bootstrap, oracle_topic, len(KEYS))
        assert len(set(expected.values())) > 1, "the keys must spread over the partitions"
        assert placed(stack.kafka_bootstrap, iso.dlq_topic, len(KEYS)) == expected
    finally:
        admin.delete_topics([oracle_topic])
        iso.cleanup()
