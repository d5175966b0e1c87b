"""How long a record waits in the broker before a consumer's fetch returns it, per fetch.max.wait.ms,
at a low steady rate (what the Flink source sees between shopper clicks); and whether a
``read_committed`` consumer sees records of aborted transactions.

    .venv/bin/python -m bench.tansu_fetch [--rate 10] [--seconds 12] [--waits 500,100,20]

A Kafka broker parks a fetch until ``fetch.min.bytes`` (1) have arrived or ``fetch.max.wait.ms`` has
passed, so on Kafka the wait setting costs no latency. This measures the broker we run on (Tansu, started
here): a consumer (librdkafka, ``fetch.wait.max.ms`` = the Java client's ``fetch.max.wait.ms``) reads
records produced at ``rate``/s; delay = receipt - the record's timestamp (set by the producer when it
is produced). The first 3 s of each setting are warm-up.

Transactions: a transactional producer writes 3 records and aborts, 2 and commits; another leaves 2
records in an open transaction and a new producer with its transactional id fences it (what a
restarted Flink KafkaSink does) and commits 1. A ``read_committed`` consumer must see 3 records.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.common import machine, paced, percentile, print_table
from devstack.broker_probe import read_committed_sees
from devstack.processes import ManagedProcess, stop
from devstack.stack import _start_tansu

WARMUP_S = 3.0


def delays(bootstrap: str, wait_ms: int, rate: float, seconds: float) -> list[float]:
    topic = f"fetch-probe-{wait_ms}-{int(time.time())}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 4, 1)]).values():
        future.result(timeout=10)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": wait_ms,
            "fetch.min.bytes": 1,
        }
    )
    consumer.subscribe([topic])
    deadline = time.monotonic() + 30
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(0.2)
    received: list[tuple[float, float]] = []
    done = threading.Event()

    def consume() -> None:
        while not done.is_set():
            message = consumer.poll(0.05)
            if message is not None and not message.error():
                received.append((time.time(), message.timestamp()[1] / 1000))

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    started = time.time()
    for n in paced(rate, seconds):
        producer.produce(topic, key=str(n % 16).encode(), value=b"x" * 300, timestamp=int(time.time() * 1000))
        producer.poll(0)
    producer.flush(10)
    time.sleep(1.5)
    done.set()
    reader.join(5)
    consumer.close()
    return [(got - sent) * 1000 for got, sent in received if sent - started > WARMUP_S]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--waits", default="500,100,20", help="fetch.max.wait.ms values")
    args = parser.parse_args()
    if args.seconds <= WARMUP_S:
        parser.error(f"--seconds must exceed the {WARMUP_S:g} s warm-up, which is not measured")
    started: list[ManagedProcess] = []
    try:
        bootstrap = _start_tansu(Path(tempfile.mkdtemp(prefix="bench-fetch-")), started)
        print(f"machine: {machine()}; Tansu, {args.rate:g} records/s, 4 partitions")
        rows = []
        for wait in (int(w) for w in args.waits.split(",")):
            values = delays(bootstrap, wait, args.rate, args.seconds)
            rows.append(
                [
                    wait,
                    len(values),
                    f"{percentile(values, 0.5):.0f}",
                    f"{percentile(values, 0.9):.0f}",
                    f"{percentile(values, 0.99):.0f}",
                    f"{max(values):.0f}",
                ]
            )
        print_table(["fetch.max.wait.ms", "records", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows)
        seen, expected = read_committed_sees(bootstrap)
        print(f"read_committed after aborted and fenced transactions: {seen} records (should be {expected})")
    finally:
        for process in reversed(started):
            stop(process)


if __name__ == "__main__":
    main()
