"""Dead letters onto the DLQ topic, so that no record a producer sends can stop the stream.

The record itself is bounded (``pipeline.dead_letter``). Producing it can still fail: the local queue
is full (``BufferError``: wait for deliveries, try again), or the DLQ refuses it (a topic or broker with
a smaller ``max.message.bytes``: send the minimal record, without the original, which the hash and the
source position still identify). A dead letter that cannot be delivered even so is counted and
reported — ``undelivered`` in the progress line and the totals — and never stops the runner. Broker
outages need no code here: librdkafka retries a queued record until ``message.timeout.ms``.

Delivery reports arrive on whichever thread polls or flushes the producer; the counters are plain ints
(one writer at a time: a report, or the event loop between awaits).
"""

from __future__ import annotations

from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES, DeadLetter, dead_letter, minimal_dead_letter

QUEUE_FULL_RETRIES = 50
TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE})


class DeadLetterPublisher:
    def __init__(
        self,
        producer: Producer,
        topic: str,
        log: Callable[[str], None],
        *,
        max_original_bytes: int = DEFAULT_MAX_ORIGINAL_BYTES,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.log = log
        self.max_original_bytes = max_original_bytes
        self.queued = 0
        self.delivered = 0
        self.shrunk = 0
        """Dead letters sent without their original because the DLQ refused the full record."""
        self.undelivered = 0

    def publish(self, message: Message, reason: str) -> DeadLetter:
        """Queue the dead letter of ``message``; returns it (for logs and tests)."""
        timestamp_type, timestamp_ms = message.timestamp()
        letter = dead_letter(
            message.value(),
            reason,
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            timestamp_ms=timestamp_ms if timestamp_type != 0 else None,  # 0: TIMESTAMP_NOT_AVAILABLE
            max_original_bytes=self.max_original_bytes,
        )
        self._produce(letter, message.key())
        return letter

    def _produce(self, letter: DeadLetter, key: bytes | str | None) -> None:
        value = letter.to_bytes()
        for _ in range(QUEUE_FULL_RETRIES):
            try:
                self.producer.produce(
                    self.topic, key=key, value=value, on_delivery=self._on_delivery(letter, key)
                )
                self.queued += 1
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
                self.delivered += 1
            else:
                self._refused(letter, key, error)

        return report

    def _refused(self, letter: DeadLetter, key: bytes | str | None, error: KafkaError | None) -> None:
        too_large = error is not None and error.code() in TOO_LARGE
        if too_large and letter.original is not None:
            self.shrunk += 1
            self._produce(
                minimal_dead_letter(letter, "original dropped: the DLQ refused the record's size"), key
            )
            return
        self._give_up(letter, str(error))

    def _give_up(self, letter: DeadLetter, why: str) -> None:
        self.undelivered += 1
        self.log(
            f"dead letter NOT delivered ({why}): {letter.topic}[{letter.partition}]@{letter.offset} "
            f"sha256 {letter.original_sha256} reason {letter.reason[:120]!r}"
        )

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every queued dead letter's delivery report; returns how many
        are still in the producer's queue."""
        return int(self.producer.flush(timeout_s))
