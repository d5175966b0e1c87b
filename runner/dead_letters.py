"""Dead letters onto the DLQ topic, so that no record a producer sends can stop the stream.

The record itself is bounded (``pipeline.dead_letter``). Producing it can still fail: the local queue
is full (``BufferError``: wait for deliveries, try again, ``QUEUE_FULL_RETRIES`` times
``QUEUE_FULL_WAIT_S`` apart), or the DLQ refuses it (a topic or broker with
a smaller ``max.message.bytes``, or this producer's own ``message.max.bytes``: send the minimal record,
without the original, which the hash and the source position still identify). A dead letter that cannot
be delivered even so is counted and reported — ``undelivered`` in the progress line, the totals and the
metrics — and never stops the runner. Broker outages need no code here: librdkafka retries a queued
record until ``message.timeout.ms``.

The counts live in a ``DeadLetterCounts`` the runner owns (``RunnerStats.dead_letters``), so they
outlive the publisher (and its librdkafka handle) and reach the final totals. Reasons are counted by
``reason_category``: a small fixed set, safe as a metric label whatever a producer sends.

``publish`` is a coroutine on the runner's event loop, and a full queue must never block that loop (the
runner's commits, timers, prompts and rebalance hand-overs all run on it): it polls without waiting and
sleeps with ``asyncio.sleep`` between attempts. ``flush`` blocks, and is called off the loop
(``asyncio.to_thread``). Delivery reports arrive on whichever thread polls or flushes the producer, inside
librdkafka's poll, where no waiting is allowed: a record the DLQ refused in a report is not sent again
from there but put aside (``_deferred``) and sent by the next ``publish`` or ``flush``, and ``flush``
counts it as still queued until then, so offsets are never committed past it. ``deliver`` waits only
for the dead letters published before it began (and the records sent in place of those): the ingest
goes on publishing meanwhile (``sinks.deliveries``). The counters are plain
ints (one writer at a time: a report, or the event loop between awaits).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES, DeadLetter, dead_letter, minimal_dead_letter
from prompt_assembly.events import EVENT_TIME_REASON
from runner.errors import DeadLettersUndelivered
from sinks.deliveries import PendingDeliveries

QUEUE_FULL_RETRIES = 50
QUEUE_FULL_WAIT_S = 0.1
"""With the retries: a dead letter waits up to 5 s for room in a full producer queue, then is counted
undelivered. librdkafka frees room as deliveries complete (``linger.ms`` plus a round trip)."""
TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE})
DEFERRED_CHECK_S = 0.1
"""How often ``flush`` looks for records put aside while it waits, to send them."""

ReasonCategory = Literal["empty", "too_large", "invalid_json", "event_time", "schema"]
REASON_CATEGORIES: tuple[ReasonCategory, ...] = ("empty", "too_large", "invalid_json", "event_time", "schema")


def reason_category(reason: str) -> ReasonCategory:
    """The category of a gate rejection (``prompt_assembly.events.parse_event``'s reasons): the reason
    text names fields and values from the record, so it never becomes a label itself."""
    if reason.startswith("empty message"):
        return "empty"
    if reason.startswith("event is ") and "-byte limit" in reason:
        return "too_large"
    if reason.startswith("invalid JSON"):
        return "invalid_json"
    if reason.startswith(EVENT_TIME_REASON):
        return "event_time"
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
        queue_full_retries: int = QUEUE_FULL_RETRIES,
        queue_full_wait_s: float = QUEUE_FULL_WAIT_S,
        deliver_max_wait_s: float = 120.0,
    ) -> None:
        """``deliver_max_wait_s``: how long ``deliver`` waits for a broker that is away (the engine's
        ``SinkRetry.max_wait_s``)."""
        self.producer = producer
        self.topic = topic
        self.log = log
        self.max_original_bytes = max_original_bytes
        self.counts = counts if counts is not None else DeadLetterCounts()
        self.queue_full_retries = queue_full_retries
        self.queue_full_wait_s = queue_full_wait_s
        self.deliver_max_wait_s = deliver_max_wait_s
        self._deferred: deque[tuple[DeadLetter, bytes | str | None, int]] = deque()
        """Minimal records to send instead of ones the DLQ refused in a delivery report, each with the
        generation of the record it replaces (``sinks.deliveries``)."""
        self._pending = PendingDeliveries()

    @property
    def delivered(self) -> int:
        return self.counts.delivered

    @property
    def shrunk(self) -> int:
        return self.counts.shrunk

    @property
    def undelivered(self) -> int:
        return self.counts.undelivered

    async def publish(self, message: Message, reason: str) -> DeadLetter:
        """Queue the dead letter of a consumed ``message``; returns it (for logs and tests)."""
        timestamp_type, timestamp_ms = message.timestamp()
        return await self.publish_value(
            message.value(),
            reason,
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            timestamp_ms=timestamp_ms if timestamp_type != 0 else None,  # 0: TIMESTAMP_NOT_AVAILABLE
            key=message.key(),
        )

    async def publish_value(
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
        """Queue the dead letter of a rejected value found at (topic, partition, offset); never raises.
        Returns once it is queued (or counted undelivered), without blocking the event loop."""
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
        await self._send(letter, key)
        while (deferred := self._take_deferred()) is not None:
            await self._send_deferred(*deferred)
        return letter

    async def _send_deferred(self, letter: DeadLetter, key: bytes | str | None, generation: int) -> None:
        """Send a record put aside, held in its generation until it is queued or given up (a durable
        point waiting for that generation must not end while it waits for room)."""
        try:
            await self._send(letter, key, generation)
        except BaseException:
            self._deferred.appendleft((letter, key, generation))  # still held: the next send takes it
            raise
        self._pending.release(generation)

    async def _send(self, letter: DeadLetter, key: bytes | str | None, generation: int | None = None) -> None:
        """Queue ``letter``; while the local queue is full, serve delivery reports (they make room)
        and sleep on the loop, never in librdkafka."""
        for _ in range(self.queue_full_retries):
            if self._try_produce(letter, key, generation):
                return
            self.producer.poll(0)
            await asyncio.sleep(self.queue_full_wait_s)
        self._give_up(letter, "the producer queue stayed full")

    def _send_blocking(self, letter: DeadLetter, key: bytes | str | None, generation: int) -> None:
        """``_send`` for ``flush``, which runs off the event loop and may wait in librdkafka."""
        for _ in range(self.queue_full_retries):
            if self._try_produce(letter, key, generation):
                return
            self.producer.poll(self.queue_full_wait_s)
        self._give_up(letter, "the producer queue stayed full")

    def _try_produce(self, letter: DeadLetter, key: bytes | str | None, generation: int | None) -> bool:
        """One attempt that never waits: False if the local queue is full, True once the letter is
        queued or handled otherwise (refused: sent minimal, or counted undelivered). ``generation``:
        the one a letter sent in place of a refused record keeps; None for the current one."""
        counted = self._pending.generation if generation is None else generation
        try:
            self._pending.produce(
                self.producer,
                self.topic,
                key=key,
                value=letter.to_bytes(),
                on_delivery=self._on_delivery(letter, key, counted),
                generation=counted,
            )
        except BufferError:
            return False
        except KafkaException as exc:
            self._refused(letter, key, exc.args[0] if exc.args else None, counted)
            return True
        self.counts.queued += 1
        return True

    def _take_deferred(self) -> tuple[DeadLetter, bytes | str | None, int] | None:
        try:
            return self._deferred.popleft()  # atomic: a report on the flush thread may add meanwhile
        except IndexError:
            return None

    def _on_delivery(
        self, letter: DeadLetter, key: bytes | str | None, generation: int
    ) -> Callable[[KafkaError | None, Message], None]:
        def report(error: KafkaError | None, _: Message) -> None:
            if error is None:
                self.counts.delivered += 1
            else:
                self._refused(letter, key, error, generation)

        return report

    def _refused(
        self, letter: DeadLetter, key: bytes | str | None, error: KafkaError | None, generation: int
    ) -> None:
        too_large = isinstance(error, KafkaError) and error.code() in TOO_LARGE
        if too_large and letter.original is not None:
            self.counts.shrunk += 1
            minimal = minimal_dead_letter(letter, "original dropped: the DLQ refused the record's size")
            self._pending.hold(generation)  # before the report's own count drops (``sinks.deliveries``)
            self._deferred.append((minimal, key, generation))  # sent by the caller: this may be a report
            return
        self._give_up(letter, str(error))

    def _give_up(self, letter: DeadLetter, why: str) -> None:
        self.counts.undelivered += 1
        self.log(
            f"dead letter NOT delivered ({why}): {letter.topic}[{letter.partition}]@{letter.offset} "
            f"sha256 {letter.original_sha256} reason {letter.reason[:120]!r}"
        )

    def flush(self, timeout_s: float, generation: int | None = None) -> int:
        """Wait up to ``timeout_s`` for the delivery report of every dead letter of ``generation`` and
        before (None: every one queued so far), sending the minimal records of those the DLQ refused
        meanwhile; returns how many are not delivered or counted yet (in the producer's queue, or put
        aside to be sent). Blocks: call it off the event loop."""
        if generation is None:
            generation = self._pending.close_generation()
        deadline = time.monotonic() + timeout_s
        while True:
            while (deferred := self._take_deferred()) is not None:
                self._send_blocking(*deferred)
                self._pending.release(deferred[2])
            # In steps, so a record put aside meanwhile (held: counted in ``remaining``) is sent.
            step = min(DEFERRED_CHECK_S, max(0.0, deadline - time.monotonic()))
            remaining = self._pending.wait(self.producer, generation, step)
            if not remaining or time.monotonic() >= deadline:
                return remaining

    async def deliver(self, *, poll_s: float = 5.0) -> None:
        """Wait until every queued dead letter has its delivery report (delivered, or counted as
        undelivered): offsets are never committed past a dead letter still in the producer's queue.
        While the broker is away this waits, as consuming does, for up to ``max_wait_s``; then raises
        ``DeadLettersUndelivered``: the ``DeadLetterQueue`` step of ``pipeline.checkpoint``."""
        generation = self._pending.close_generation()  # what is published from now on is the next one's
        waited = 0.0
        while await asyncio.to_thread(self.flush, poll_s, generation):
            waited += poll_s
            if waited >= self.deliver_max_wait_s:
                raise DeadLettersUndelivered(
                    f"dead letters not delivered to {self.topic} within {waited:.0f} s "
                    "(RUNNER_SINK_RETRY__MAX_WAIT_S); nothing past them was committed"
                )
