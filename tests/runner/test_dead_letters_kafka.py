"""Dead letters at the size limits, against the real broker: nothing a producer sends stops the stream.

The limits that matter, and what was found about them here:
- librdkafka's producer refuses a record over its ``message.max.bytes`` (1,000,000 by default) before it
  leaves the process (``MSG_SIZE_TOO_LARGE``, raised by ``produce``). That is the limit the runner's own
  DLQ producer meets.
- A Kafka broker refuses a batch over ``message.max.bytes`` (1,048,588 by default) or over a topic's
  ``max.message.bytes``. Tansu 0.6 stores a topic's ``max.message.bytes`` (describe_configs returns it)
  but does not enforce it, nor any broker-wide limit: a 12 MB record was accepted. So on Tansu the
  event topic takes every size below, and the DLQ's refusal is exercised through the producer limit;
  with a real Kafka (Docker) the topics' ``max.message.bytes`` set here are enforced as well.

Every hostile record goes onto the event topic with a producer whose ``message.max.bytes`` is raised,
as a misconfigured upstream would; the runner must dead-letter each one with a bounded record, keep
going, and account for every event.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka._types import DeliveryCallback, HeadersType
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES, MAX_REASON_CHARS, DeadLetter, dead_letter
from prompt_assembly.events import MAX_EVENT_BYTES
from runner.dead_letters import DeadLetterPublisher
from runner.embedded import EmbeddedRunner
from shopper.readback import read_dlq
from tests.conftest import Isolated
from tests.helpers import expected_prompts
from tests.slow_link import tansu_behind_slow_link

pytestmark = pytest.mark.slow

PRODUCER_LIMIT = 1_000_000
"""librdkafka's default ``message.max.bytes``."""
BROKER_LIMIT = 1_048_588
"""Kafka's default broker ``message.max.bytes``."""
EVENT_TOPIC_LIMIT = 8 * 1024 * 1024
"""The events topic's ``max.message.bytes`` here: a broker that allows large records upstream."""
DLQ_TOPIC_LIMIT = 256 * 1024
"""The DLQ's ``max.message.bytes``: smaller than the biggest dead letter the second test makes."""

HOSTILE_SIZES = [
    MAX_EVENT_BYTES,  # at the gate's own limit (not a valid event: padding)
    MAX_EVENT_BYTES + 1,
    PRODUCER_LIMIT - 1_000,  # just below a default producer's limit
    PRODUCER_LIMIT,  # at it
    BROKER_LIMIT,  # at a default broker's limit
    BROKER_LIMIT + 1,  # just above it
    2 * 1024 * 1024,  # the ~2 MB record that used to stop the runner
    5 * 1024 * 1024,
]


def hostile_records() -> list[tuple[bytes, bytes, bool]]:
    """Oversized text records, an oversized binary one (base64 in its dead letter) and one of JSON
    control-character escapes (the worst case for the dead letter's size)."""
    records = [(f"hostile-{size}".encode(), b"x" * size, True) for size in HOSTILE_SIZES]
    records.append((b"hostile-binary", bytes(range(256)) * 6_000, True))
    records.append((b"hostile-controls", b"\x01" * 300_000, True))
    return records


@pytest.fixture
def limits(stack: StackState) -> Iterator[Isolated]:
    """An isolated topic pair with the size limits above (honoured by Kafka, stored by Tansu)."""
    iso = Isolated(stack)
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(iso.topic, 2, 1, config={"max.message.bytes": str(EVENT_TOPIC_LIMIT)}),
            NewTopic(iso.dlq_topic, 1, 1, config={"max.message.bytes": str(DLQ_TOPIC_LIMIT)}),
        ]
    )
    for future in futures.values():
        future.result(timeout=10)
    yield iso
    iso.cleanup()


def produce_large(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, bool]]) -> None:
    """As an upstream with a raised ``message.max.bytes`` would."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "message.max.bytes": EVENT_TOPIC_LIMIT + 100_000,
            "linger.ms": 5,
            "log.connection.close": False,
        }
    )
    for key, value, _ in records:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(60) == 0


def stream_with_hostile_records(seed: int) -> list[tuple[bytes, bytes, bool]]:
    """Good events with the hostile records spread among them."""
    good = SyntheticStream(shoppers=20, seed=seed).take(300)
    hostile = hostile_records()
    step = len(good) // (len(hostile) + 1)
    records = list(good)
    for i, record in enumerate(hostile):
        records.insert((i + 1) * step + i, record)
    return records


def original_of(letter: DeadLetter) -> bytes:
    assert letter.original is not None
    if letter.original_encoding == "base64":
        return base64.b64decode(letter.original)
    return letter.original.encode()


def run_runner(iso: Isolated, **overrides: object) -> tuple[EmbeddedRunner, list[str]]:
    lines: list[str] = []
    runner = EmbeddedRunner(iso.runner(**overrides), log=lines.append)
    asyncio.run(runner.run())
    return runner, lines


def test_records_at_and_past_every_size_limit_are_dead_lettered_bounded_and_the_stream_goes_on(
    limits: Isolated,
) -> None:
    records = stream_with_hostile_records(seed=61)
    produce_large(limits.stack.kafka_bootstrap, limits.topic, records)
    expected = expected_prompts(records)

    runner, lines = run_runner(limits)

    acct = runner.stats.accounting
    hostile = {value: key for key, value, bad in records if bad}
    assert acct.consumed == len(records), "the runner read past every large record"
    assert acct.dead_lettered == len(hostile) and acct.balanced
    assert acct.prompts == len(expected) and acct.errors == 0
    assert runner.undelivered_dead_letters == 0, lines[-5:]

    raw = read_dlq(limits.stack.kafka_bootstrap, limits.dlq_topic)
    letters = [DeadLetter.model_validate(d) for d in raw]
    assert len(letters) == len(hostile)
    by_hash = {hashlib.sha256(value).hexdigest(): value for value in hostile}
    bound = 6 * (DEFAULT_MAX_ORIGINAL_BYTES + MAX_REASON_CHARS)
    for letter in letters:
        value = by_hash[letter.original_sha256 or ""]  # the hash names the original exactly
        assert letter.original_size == len(value)
        assert len(letter.to_bytes()) <= bound, "a dead letter is bounded whatever came in"
        assert letter.truncated == (len(value) > DEFAULT_MAX_ORIGINAL_BYTES)
        assert value.startswith(original_of(letter)), "what is kept is the original's head, unchanged"
        assert letter.reason


def test_a_dead_letter_the_dlq_refuses_for_size_is_sent_without_its_original(limits: Isolated) -> None:
    """Dead letters allowed to keep 6 MB of the original: those above the DLQ producer's limit are
    refused by it, and go as the minimal record (hash, size and position, no original); the runner
    neither stops nor loses one."""
    records = stream_with_hostile_records(seed=62)
    produce_large(limits.stack.kafka_bootstrap, limits.topic, records)

    runner, lines = run_runner(limits, dlq_max_original_bytes=6 * 1024 * 1024)

    acct = runner.stats.accounting
    hostile = [value for _, value, bad in records if bad]
    assert acct.consumed == len(records) and acct.balanced
    assert runner.undelivered_dead_letters == 0, lines[-5:]
    letters = [DeadLetter.model_validate(d) for d in read_dlq(limits.stack.kafka_bootstrap, limits.dlq_topic)]
    assert sorted(letter.original_sha256 or "" for letter in letters) == sorted(
        hashlib.sha256(v).hexdigest() for v in hostile
    )
    by_hash = {hashlib.sha256(value).hexdigest(): value for value in hostile}
    for letter in letters:
        value = by_hash[letter.original_sha256 or ""]
        full_size = len(dead_letter(value, "r", max_original_bytes=len(value)).to_bytes())
        if letter.original is None:  # refused whole, sent minimal
            assert letter.truncated and "DLQ refused" in letter.reason
            assert full_size > PRODUCER_LIMIT * 0.95
        else:
            assert not letter.truncated and full_size < PRODUCER_LIMIT
    shrunk = sum(1 for letter in letters if letter.original is None)
    assert shrunk >= 5, "the records at and above the producer's limit were all shrunk"
    assert runner.stats.dead_letters.shrunk == shrunk


async def test_a_dead_letter_that_can_never_be_produced_is_counted_not_fatal(limits: Isolated) -> None:
    """A DLQ producer whose limit is below even the minimal record (librdkafka's minimum, 1,000
    bytes, and a long reason): each dead letter is refused twice, counted as undelivered and logged;
    ``publish`` never raises."""
    lines: list[str] = []
    producer = Producer(
        {"bootstrap.servers": limits.stack.kafka_bootstrap, "message.max.bytes": 1_000, "linger.ms": 0}
    )
    publisher = DeadLetterPublisher(producer, limits.dlq_topic, lines.append)
    for i in range(3):
        await publisher.publish_value(b"y" * 50_000, "z" * 2_000, topic=limits.topic, partition=0, offset=i)
    assert await asyncio.to_thread(publisher.flush, 10) == 0
    assert publisher.undelivered == 3 and publisher.shrunk == 3 and publisher.delivered == 0
    assert sum("NOT delivered" in line for line in lines) == 3


async def test_a_full_producer_queue_waits_for_deliveries_instead_of_failing(limits: Isolated) -> None:
    """A producer queue of two records: ``produce`` raises ``BufferError`` at the third; the
    publisher lets deliveries drain it and every dead letter arrives."""
    producer = Producer(
        {
            "bootstrap.servers": limits.stack.kafka_bootstrap,
            "queue.buffering.max.messages": 2,
            "linger.ms": 50,
        }
    )
    publisher = DeadLetterPublisher(producer, limits.dlq_topic, lambda _: None)
    started = time.monotonic()
    for i in range(40):
        await publisher.publish_value(
            b"not json %d" % i, "invalid JSON", topic=limits.topic, partition=1, offset=i
        )
    assert await asyncio.to_thread(publisher.flush, 30) == 0, f"after {time.monotonic() - started:.1f} s"
    assert publisher.delivered == 40 and publisher.undelivered == 0
    offsets = sorted(d["offset"] for d in read_dlq(limits.stack.kafka_bootstrap, limits.dlq_topic))
    assert offsets == list(range(40))


async def test_a_full_producer_queue_never_blocks_the_event_loop(limits: Isolated) -> None:
    """A producer queue of one record that lingers a second: every dead letter after the first waits
    about a second for room. That wait used to be ``producer.poll`` on the event loop, which froze
    the runner's commits, timers, prompts and rebalance hand-overs meanwhile; now the loop keeps
    running (a coroutine ticking every 10 ms never misses more than a few ticks), and every dead
    letter still arrives, counted once."""
    producer = Producer(
        {
            "bootstrap.servers": limits.stack.kafka_bootstrap,
            "queue.buffering.max.messages": 1,
            "linger.ms": 1000,
        }
    )
    publisher = DeadLetterPublisher(producer, limits.dlq_topic, lambda _: None)
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())

    started = time.monotonic()
    ticking = asyncio.create_task(ticker())
    for i in range(4):
        await publisher.publish_value(
            b"not json %d" % i, "invalid JSON", topic=limits.topic, partition=0, offset=i
        )
    ended = time.monotonic()
    ticking.cancel()
    assert ended - started > 2.0, "the queue was full: each dead letter after the first waited for room"
    moments = [started, *ticks, ended]
    stall = max(later - earlier for earlier, later in itertools.pairwise(moments))
    assert stall < 0.5, f"the event loop stalled for {stall:.2f} s (publishing took {ended - started:.2f} s)"
    assert await asyncio.to_thread(publisher.flush, 30) == 0
    counts = publisher.counts
    assert counts.queued == counts.delivered == 4 and counts.undelivered == 0
    offsets = sorted(d["offset"] for d in read_dlq(limits.stack.kafka_bootstrap, limits.dlq_topic))
    assert offsets == [0, 1, 2, 3]


async def test_a_queue_that_stays_full_counts_the_dead_letter_undelivered(limits: Isolated) -> None:
    """Room never comes within the bound (``queue_full_retries`` x ``queue_full_wait_s``, short
    here; the record ahead lingers 3 s): the dead letter is given up, counted and logged, never lost
    silently; the one queued is delivered. Every dead letter is accounted for."""
    producer = Producer(
        {
            "bootstrap.servers": limits.stack.kafka_bootstrap,
            "queue.buffering.max.messages": 1,
            "linger.ms": 3000,
        }
    )
    lines: list[str] = []
    publisher = DeadLetterPublisher(
        producer, limits.dlq_topic, lines.append, queue_full_retries=5, queue_full_wait_s=0.02
    )
    for i in range(3):
        await publisher.publish_value(
            b"not json %d" % i, "invalid JSON", topic=limits.topic, partition=0, offset=i
        )
    assert publisher.counts.queued == 1 and publisher.undelivered == 2
    assert sum("NOT delivered (the producer queue stayed full)" in line for line in lines) == 2
    assert await asyncio.to_thread(publisher.flush, 30) == 0
    assert publisher.delivered == 1 and publisher.delivered + publisher.undelivered == 3
    assert [d["offset"] for d in read_dlq(limits.stack.kafka_bootstrap, limits.dlq_topic)] == [0]


class BrokerSizeLimit(Producer):
    """A real producer on the real broker, except that a record over ``limit`` bytes goes to
    ``refused_topic`` and its delivery report says ``MSG_SIZE_TOO_LARGE``: what a Kafka broker whose DLQ
    topic has ``max.message.bytes`` = ``limit`` answers. A fake, because no real part here can make
    this case: Tansu 0.6 enforces no size limit (see the module docstring), and librdkafka's own
    ``message.max.bytes`` refuses in ``produce``, never in a delivery report. The report still comes
    from the broker's acknowledgement, on whichever thread polls or flushes."""

    def __init__(self, config: dict[str, str | int | bool], *, limit: int, refused_topic: str) -> None:
        super().__init__(config)
        self.limit = limit
        self.refused_topic = refused_topic

    def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int = -1,
        callback: DeliveryCallback | None = None,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int = 0,
        headers: HeadersType | None = None,
    ) -> None:
        report = on_delivery or callback
        if value is not None and len(value) > self.limit and report is not None:
            refused_report = report

            def too_large(error: KafkaError | None, message: object) -> None:
                refused_report(error or KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), message)

            topic, report = self.refused_topic, too_large
        super().produce(
            topic,
            value=value,
            key=key,
            partition=partition,
            on_delivery=report,
            timestamp=timestamp,
            headers=headers,
        )


async def test_flush_counts_a_letter_refused_for_size_in_its_report_until_it_is_sent_minimal(
    limits: Isolated,
) -> None:
    """The DLQ refuses a dead letter for its size in the delivery report that ``flush`` serves: the
    minimal record is put aside, and a flush whose time is up before it is sent must count it as still
    to deliver (offsets must not be committed past it). The next flush sends it; the DLQ holds only it.
    The size refusal comes from ``BrokerSizeLimit`` (a fake: Tansu enforces no size limit)."""
    bootstrap = limits.stack.kafka_bootstrap
    producer = BrokerSizeLimit(
        {"bootstrap.servers": bootstrap, "linger.ms": 0},
        limit=4_000,
        refused_topic=f"{limits.dlq_topic}-refused",
    )
    lines: list[str] = []
    publisher = DeadLetterPublisher(producer, limits.dlq_topic, lines.append)
    await publisher.publish_value(b"y" * 20_000, "invalid JSON", topic=limits.topic, partition=0, offset=7)
    assert publisher.counts.queued == 1 and publisher.shrunk == 0
    deadline = time.monotonic() + 20
    while publisher.shrunk == 0:  # flush(0) serves the report once the broker has answered
        assert time.monotonic() < deadline, "no delivery report"
        left = await asyncio.to_thread(publisher.flush, 0)
        if publisher.shrunk == 0:
            assert left == 1, "the letter is in the producer's queue"
            await asyncio.sleep(0.05)
    assert left == 1, "refused and put aside, not yet sent minimal: still to deliver"
    assert publisher.delivered == 0 and publisher.undelivered == 0
    assert await asyncio.to_thread(publisher.flush, 15) == 0
    assert publisher.delivered == 1 and publisher.shrunk == 1 and publisher.undelivered == 0, lines
    letters = [DeadLetter.model_validate(d) for d in read_dlq(bootstrap, limits.dlq_topic)]
    assert len(letters) == 1
    (letter,) = letters
    assert letter.original is None and letter.offset == 7 and "DLQ refused" in letter.reason
    assert letter.original_sha256 == hashlib.sha256(b"y" * 20_000).hexdigest()


async def test_a_dead_letter_refused_for_another_reason_than_size_is_undelivered_not_shrunk(
    limits: Isolated,
) -> None:
    """The DLQ topic does not exist and the producer asks the broker not to create it
    (``allow.auto.create.topics`` off): the real broker answers UNKNOWN_TOPIC_OR_PART in each letter's
    delivery report. Dropping the original would not help, so the letter is not counted as shrunk: it
    is counted undelivered once, and logged with the broker's reason."""
    producer = Producer(
        {
            "bootstrap.servers": limits.stack.kafka_bootstrap,
            "allow.auto.create.topics": False,
            "topic.metadata.propagation.max.ms": 1000,
            "linger.ms": 0,
        }
    )
    lines: list[str] = []
    publisher = DeadLetterPublisher(producer, f"{limits.dlq_topic}-never-created", lines.append)
    for i in range(2):
        await publisher.publish_value(b"y" * 5_000, "invalid JSON", topic=limits.topic, partition=0, offset=i)
    assert await asyncio.to_thread(publisher.flush, 20) == 0
    counts = publisher.counts
    assert (counts.queued, counts.delivered, counts.shrunk, counts.undelivered) == (2, 0, 0, 2), lines
    refusals = [line for line in lines if "NOT delivered" in line]
    assert len(refusals) == 2 and all("Unknown topic" in line for line in refusals), refusals


async def test_deliver_under_steady_dead_letters_waits_only_for_those_before_it(tmp_path: Path) -> None:
    """The ingest publishes dead letters while a durable point waits for them. Over a link whose round
    trip is longer than the gap between two, the producer's queue is never empty, and ``deliver``,
    which waited for an empty queue (librdkafka's ``flush``), ran out ``deliver_max_wait_s`` and
    failed the runner with the broker healthy. It waits for the dead letters published before it began,
    each delivered when it returns. A real broker 20 ms away (``tests.slow_link``), a dead letter every
    2 ms."""
    with tansu_behind_slow_link(tmp_path, delay_s=0.02) as bootstrap:
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
        publisher = DeadLetterPublisher(producer, "dlq-slow-link", lambda _: None, deliver_max_wait_s=3)
        published = 0
        stop = asyncio.Event()

        async def keep_publishing() -> None:
            nonlocal published
            while not stop.is_set():
                await publisher.publish_value(
                    b"not json", "invalid JSON", topic="events", partition=0, offset=published
                )
                published += 1
                await asyncio.sleep(0.002)

        await publisher.publish_value(b"not json", "invalid JSON", topic="events", partition=0, offset=-1)
        await publisher.deliver(poll_s=1)  # the topic is made and the producer connected first
        publishing = asyncio.create_task(keep_publishing())
        try:
            for _ in range(3):
                await asyncio.sleep(0.3)
                before = published + 1
                await publisher.deliver(poll_s=1)
                assert publisher.delivered >= before, "deliver returned before an earlier dead letter was"
            assert published > 300, "dead letters were published all along"
        finally:
            stop.set()
            await publishing
        assert await asyncio.to_thread(publisher.flush, 10) == 0
        assert publisher.delivered == published + 1 and publisher.undelivered == 0


async def test_deliver_waits_for_a_minimal_record_still_waiting_for_room(limits: Isolated) -> None:
    """A dead letter the DLQ refused for its size is put aside; the next ``publish`` takes it to send
    the minimal record, and finds the producer's queue full (one record, lingering a second), so it
    waits for room. A durable point meanwhile must not end before that record is on the DLQ: it was
    in neither the put-aside list nor the producer's queue then, so ``deliver`` returned once the queue
    drained, and a kill would have committed past a dead letter the DLQ never got. It is now held in its
    generation from being put aside until it is queued. Size refusal from ``BrokerSizeLimit``."""
    bootstrap = limits.stack.kafka_bootstrap
    producer = BrokerSizeLimit(
        {"bootstrap.servers": bootstrap, "queue.buffering.max.messages": 1, "linger.ms": 1000},
        limit=4_000,
        refused_topic=f"{limits.dlq_topic}-refused",
    )
    publisher = DeadLetterPublisher(producer, limits.dlq_topic, lambda _: None, queue_full_wait_s=0.2)
    await publisher.publish_value(b"y" * 20_000, "invalid JSON", topic=limits.topic, partition=0, offset=1)
    deadline = time.monotonic() + 20
    while publisher.shrunk == 0:  # its report, refused for size: the minimal record is put aside
        assert time.monotonic() < deadline, "no delivery report"
        await asyncio.to_thread(producer.poll, 0.1)
    # The next dead letter fills the queue; its publish then waits for room for the minimal record.
    publishing = asyncio.create_task(
        publisher.publish_value(b"not json", "invalid JSON", topic=limits.topic, partition=0, offset=2)
    )
    await asyncio.sleep(0.05)
    await publisher.deliver(poll_s=5)
    delivered_at_deliver = publisher.delivered
    await publishing
    assert delivered_at_deliver == 2, "deliver returned before the minimal record was on the DLQ"
    offsets = sorted(d["offset"] for d in read_dlq(bootstrap, limits.dlq_topic))
    assert offsets == [1, 2]
