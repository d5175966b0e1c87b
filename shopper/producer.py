"""``shopper produce``: the synthetic stream onto Kafka, at a rate or as fast as possible."""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson
from confluent_kafka import Producer

from devstack.synthetic import SyntheticStream
from pipeline.kafka_security import KafkaSecurity, librdkafka_properties
from prompt_assembly.errors import ShopperError


@dataclass
class ProduceReport:
    sent: int
    malformed: int
    seconds: float


def produce(
    bootstrap: str,
    topic: str,
    *,
    events: int,
    shoppers: int,
    rate: float | None,
    malformed_rate: float,
    seed: int,
    realtime_ts: bool = False,
    security: KafkaSecurity | None = None,
) -> ProduceReport:
    """Send ``events`` records; ``rate`` (events/s) paces them, None sends as fast as possible.
    ``realtime_ts`` stamps each event, and its record, with the wall clock as it is sent, instead of the
    simulated event time; ``security``: TLS/SASL, the runner's (``RUNNER_KAFKA_SECURITY__*``) when run
    as ``shopper produce``."""
    stream = SyntheticStream(
        shoppers=shoppers,
        seed=seed,
        malformed_rate=malformed_rate,
        start_ts=time.time() if realtime_ts else 1_761_800_000.0,
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 10,
            "batch.num.messages": 10000,
            "log.connection.close": False,
            **librdkafka_properties(security or KafkaSecurity()),
        }
    )
    started = time.perf_counter()
    malformed = 0
    for i in range(events):
        key, value, bad = stream.next_record()
        malformed += bad
        now = time.time()
        if realtime_ts and not bad:
            value = stamped(value, now)
        while True:
            try:
                # 0: librdkafka stamps the record when it takes it
                producer.produce(topic, key=key, value=value, timestamp=int(now * 1000) if realtime_ts else 0)
                break
            except BufferError:
                producer.poll(0.05)
        if rate:
            target = started + (i + 1) / rate
            delay = target - time.perf_counter()
            if delay > 0:
                producer.poll(0)
                time.sleep(delay)
        elif i % 10000 == 0:
            producer.poll(0)
    remaining = producer.flush(30)
    if remaining:
        raise EventsUndelivered(f"{remaining} events were not delivered to the broker within 30 s")
    return ProduceReport(events, malformed, time.perf_counter() - started)


def stamped(value: bytes, now: float) -> bytes:
    """The event with ``ts`` set to ``now``. Starting the simulated clock at the wall clock was not
    enough: it moves by the stream's gaps between clicks, not by the time a send takes, so it ran
    minutes ahead of the wall, and the event-time gate dead-letters an event more than 300 s after
    its record's timestamp."""
    event = orjson.loads(value)
    event["ts"] = round(now, 3)
    return orjson.dumps(event)


class EventsUndelivered(ShopperError):
    """``shopper produce`` could not hand every event to the broker."""
