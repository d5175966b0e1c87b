"""Dead letters onto the DLQ topic, so that no record a producer sends can stop the stream.

The record itself is bounded (``pipeline.dead_letter``). Producing it can still fail: the local queue
is full (``BufferError``: wait for deliveries, try again), or the DLQ refuses it (a topic or broker with
a smaller ``max.message.bytes``, or this producer's own ``message.max.bytes``: send the minimal record,
without the original, which the hash and the source position still identify). A dead letter that cannot
be delivered even so is counted and reported — ``undelivered`` in the progress line, the totals and the
metrics — and never stops the runner. Broker outages need no code here: librdkafka retries a queued
record until ``message.timeout.ms``.

The counts live in a ``DeadLetterCounts`` the runner owns (``RunnerStats.dead_letters``), so they
outlive the publisher (and its librdkafka handle) and reach the final totals. Reasons are counted by
``reason_category``: a small fixed set, safe as a metric label whatever a producer sends.

Delivery reports arrive on whichever thread polls or flushes the producer; the counters are plain ints
(one writer at a time: a report, or the event loop between awaits).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES, DeadLetter, dead_letter, minimal_dead_letter

QUEUE_FULL_RETRIES = 50
TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE})

ReasonCategory = Literal["empty", "too_large", "invalid_json", "schema"]
REASON_CATEGORIES: tuple[ReasonCategory, ...] = ("empty", "too_large", "invalid_json", "schema")


def reason_category(reason: str) -> ReasonCategory:
    """The category of a gate rejection (``prompt_assembly.events.parse_event``'s reasons): the reason
    text names fields and values from the record, so it never becomes a label itself."""
    if reason.startswith("empty message"):
        return "empty"
    if reason.startswith("event is ") and "-byte limit" in reason:
        return "too_large"
    if reason.startswith("invalid JSON"):
        return "invalid_json"
    return "schema"


@dataclass(slots=True)
class DeadLetterCounts:
    queued: int = 0
    delivered: int = 0
    shrunk: int = 0
    """Sent without their original because the DLQ refused the full record."""
    undelivered: int = 0
    """Refused even as the minimal record, or the producer's queue stayed full: logged, not on the DLQ."""
    by_reason: Counter[ReasonCategory] = field(default_factory=Counter)
    """Dead letters published, by ``reason_category``."""


class DeadLetterPublisher:
    def __init__(
        self,
        producer: Producer,
        topic: str,
        log: Callable[[str], None],
        *,
        max_original_bytes: int = DEFAULT_MAX_ORIGINAL_BYTES,
        counts: DeadLetterCounts | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.log = log
        self.max_original_bytes = max_original_bytes
        self.counts = counts if counts is not None else DeadLetterCounts()

    @property
    def delivered(self) -> int:
        return self.counts.delivered

    @property
    def shrunk(self) -> int:
        return self.counts.shrunk

    @property
    def undelivered(self) -> int:
        return self.counts.undelivered

    def publish(self, message: Message, reason: str) -> DeadLetter:
        """Queue the dead letter of a consumed ``message``; returns it (for logs and tests)."""
        timestamp_type, timestamp_ms = message.timestamp()
        return self.publish_value(
            message.value(),
            reason,
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            timestamp_ms=timestamp_ms if timestamp_type != 0 else None,  # 0: TIMESTAMP_NOT_AVAILABLE
            key=message.key(),
        )

    def publish_value(
        self,
        value: bytes | None,
        reason: str,
        *,
        topic: str | None,
        partition: int | None,
        offset: int | None,
        timestamp_ms: int | None = None,
        key: bytes | str | None = None,
    ) -> DeadLetter:
        """Queue the dead letter of a rejected value found at (topic, partition, offset); never raises."""
        letter = dead_letter(
            value,
            reason,
            topic=topic,
            partition=partition,
            offset=offset,
            timestamp_ms=timestamp_ms,
            max_original_bytes=self.max_original_bytes,
        )
        self.counts.by_reason[reason_category(reason)] += 1
        self._produce(letter, key)
        return letter

    def _produce(self, letter: DeadLetter, key: bytes | str | None) -> None:
        value = letter.to_bytes()
        for _ in range(QUEUE_FULL_RETRIES):
            try:
                self.producer.produce(
                    self.topic, key=key, value=value, on_delivery=self._on_delivery(letter, key)
                )
                self.counts.queued += 1
                return
            except BufferError:
                self.producer.poll(0.1)  # the local queue is full: let deliveries drain it
            except KafkaException as exc:
                self._refused(letter, key, exc.args[0] if exc.args else None)
                return
        self._give_up(letter, "the producer queue stayed full")

    def _on_delivery(
        self, letter: DeadLetter, key: bytes | str | None
    ) -> Callable[[KafkaError | None, Message], None]:
        def report(error: KafkaError | None, _: Message) -> None:
            if error is None:
                self.counts.delivered += 1
            else:
                self._refused(letter, key, error)

        return report

    def _refused(self, letter: DeadLetter, key: bytes | str | None, error: KafkaError | None) -> None:
        too_large = isinstance(error, KafkaError) and error.code() in TOO_LARGE
        if too_large and letter.original is not None:
            self.counts.shrunk += 1
            self._produce(
                minimal_dead_letter(letter, "original dropped: the DLQ refused the record's size"), key
            )
            return
        self._give_up(letter, str(error))

    def _give_up(self, letter: DeadLetter, why: str) -> None:
        self.counts.undelivered += 1
        self.log(
            f"dead letter NOT delivered ({why}): {letter.topic}[{letter.partition}]@{letter.offset} "
            f"sha256 {letter.original_sha256} reason {letter.reason[:120]!r}"
        )

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every queued dead letter's delivery report; returns how many
        are still in the producer's queue."""
        return int(self.producer.flush(timeout_s))
