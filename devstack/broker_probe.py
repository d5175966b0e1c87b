"""What the Kafka-protocol broker we run on really does, where tests must know it.

Tansu 0.6.0 serves the records of aborted and fenced transactions to ``read_committed`` consumers
(measured: 8 records seen where Kafka shows 3). A restarted Flink ``KafkaSink`` aborts the transactions
its lost TaskManager left open, so on Tansu a reader can see a replayed insight twice; on Kafka it
cannot. Tests that check exactly-once delivery ask the broker first (``hides_aborted_transactions``)
and are strict wherever the broker can show it.
"""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]


def read_committed_sees(bootstrap: str) -> tuple[int, int]:
    """(records a read_committed consumer sees, records it should see) after aborted and fenced
    transactions."""
    topic = f"txn-probe-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(timeout=10)
    first = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-a"})
    first.init_transactions(10)
    for values, commit in ((["aborted"] * 3, False), (["committed"] * 2, True)):
        first.begin_transaction()
        for value in values:
            first.produce(topic, value=value.encode())
        first.flush(10)
        (first.commit_transaction if commit else first.abort_transaction)(10)
    orphan = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-b"})
    orphan.init_transactions(10)
    orphan.begin_transaction()
    for _ in range(2):
        orphan.produce(topic, value=b"open at the crash")
    orphan.flush(10)
    successor = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-b"})
    successor.init_transactions(10)  # fences the orphan and aborts its open transaction
    successor.begin_transaction()
    successor.produce(topic, value=b"after the fence")
    successor.commit_transaction(10)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen = 0
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        message = consumer.poll(0.3)
        if message is not None and not message.error():
            seen += 1
    consumer.close()
    return seen, 3


def hides_aborted_transactions(bootstrap: str) -> bool:
    """True when a ``read_committed`` consumer of this broker sees only committed records."""
    seen, committed = read_committed_sees(bootstrap)
    return seen == committed
