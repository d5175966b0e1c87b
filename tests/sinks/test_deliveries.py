"""``sinks.deliveries.PendingDeliveries`` against the real broker: what a durable point waits for."""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import KafkaError, Message, Producer

from sinks.deliveries import PendingDeliveries
from tests.conftest import Isolated


async def test_a_record_is_counted_until_its_report_is_handled(isolated: Isolated) -> None:
    """A report handler puts aside what it must send again (the dead letters' minimal records) and
    holds it; were the count to drop before the handler ran, a wait on another thread could end in
    between, with the record neither counted nor held."""
    producer = Producer({"bootstrap.servers": isolated.stack.kafka_bootstrap, "linger.ms": 0})
    pending = PendingDeliveries()
    seen_inside: list[int] = []

    def report(error: KafkaError | None, _: Message) -> None:
        assert error is None
        seen_inside.append(pending.undelivered(0))

    pending.produce(producer, isolated.insights_topic, value=b"r", on_delivery=report)
    assert pending.undelivered(0) == 1
    assert await asyncio.to_thread(pending.wait, producer, 0, 15) == 0
    assert seen_inside == [1] and pending.undelivered(0) == 0


async def test_a_wait_covers_its_generation_and_sends_what_lingers_at_once(isolated: Isolated) -> None:
    """Records of a later generation are not waited for; those of the generation waited for are sent
    without their ``linger.ms`` (five seconds here), as librdkafka's flush sends them; a record held
    (put aside, not yet produced) keeps the wait from ending until it is released."""
    producer = Producer({"bootstrap.servers": isolated.stack.kafka_bootstrap, "linger.ms": 5000})
    pending = PendingDeliveries()
    pending.produce(producer, isolated.insights_topic, value=b"first")
    pending.hold(0)
    closed = pending.close_generation()
    pending.produce(producer, isolated.insights_topic, value=b"later")
    assert (closed, pending.undelivered(closed), pending.undelivered(1)) == (0, 2, 3)
    assert await asyncio.to_thread(pending.wait, producer, closed, 1.5) == 1, "the held record"
    pending.release(closed)
    started = time.monotonic()
    assert await asyncio.to_thread(pending.wait, producer, closed, 15) == 0
    assert time.monotonic() - started < 4, "the wait sat out linger.ms"
    assert await asyncio.to_thread(pending.wait, producer, 1, 15) == 0
