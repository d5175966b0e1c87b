"""Repartition by shopper id: an event whose Kafka key is not its shopper id is produced to the
runner's repartition topic, keyed by the shopper id, and the copy is what the runner applies.

Why: the runner owns sessions by partition. An unkeyed event (placed at random) or one keyed by
something else (a session id, a device id) lands on a partition another member may own, so two
runners held the same shopper, or its click was applied after the purchase that followed it. Kafka
Streams repartitions through a topic of its own before any stateful step, and the Flink job re-keys
by ``shopper_id`` in its source query (``keyBy``: no topic); this is the runner's equivalent. The
copies go to a topic of the runner's own (``RunnerSettings.repartition_topic_name``: by default
``{topic}.{group_id}.repartition``), never back to the event topic, where every other consumer of the
events (another runner group, an archive, the Flink job) would have read each mis-keyed event twice.

The repartition topic has the event topic's partition count (``ensure_topic`` creates it so at start,
with the event topic's replication, and refuses one with another count), and the runner subscribes to
both with the range assignor: partition ``p`` of both topics goes to the same member, so the copy of a
shopper's event reaches the member that owns the shopper's correctly keyed events.

Guarantees: the original's offset is committed only after the copy's delivery is acknowledged (the
copies are delivered at every durable point, before the sessions are saved and the offsets committed:
``Deliveries``; each durable point waits only for the copies sent before it began, since the ingest
goes on re-keying meanwhile: ``sinks.deliveries``), so a crash replays the original and produces the
copy again; the session drops the
second copy as a duplicate (same ``event_id``). The copy keeps the original's value and timestamp
(so the event-time gate answers the same) and names the original in its one header (``REKEYED_FROM``,
never re-keyed again). It does not copy the original's headers: nothing downstream reads them, and the
gate bounds only the value, so a record with a megabyte of headers made a copy too large for the
topic, which stopped the runner on that record at every restart. The copy goes to the partition
``rekey_partitioner`` picks for the shopper id: the partitioner of the producers that key correctly
(librdkafka's ``consistent_random`` for confluent-kafka, kcat and ``shopper produce``;
``murmur2_random`` for Java clients). The copy comes after the shopper's events read meanwhile: it is
applied late, as a late event is
(``prompt_assembly.session``). Accounting: the original counts as ``rekeyed``
(``shopper_events_rekeyed_total``), the copy, consumed from the repartition topic, as accepted or a
duplicate, so every record consumed is accounted for once.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from pipeline.topic_ends import topic_lag
from prompt_assembly.events import ShopperEvent
from runner.consumer_errors import classify, consumer_failed, topic_missing
from runner.errors import ConsumerFailed, RekeyUndelivered
from sinks.deliveries import PendingDeliveries

QUEUE_FULL_WAIT_S = 0.1
REKEYED_FROM = "shopper-rekeyed-from"
"""Header of a copy: ``topic:partition:offset`` of the record it copies. A record that carries it is a
copy already and is applied where it is, never re-keyed again."""
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
"""What Kafka accepts as a topic name."""
METADATA_WAIT_S = 1.0
SETTING = "RUNNER_REPARTITION_TOPIC"


def misplaced(message: Message, event: ShopperEvent) -> bool:
    """The record's key is not its event's shopper id (none, or another one), and it is no copy."""
    if message.key() == event.shopper_id.encode():
        return False
    return REKEYED_FROM not in header_names(message)


def header_names(message: Message) -> list[str]:
    headers = message.headers() or []
    return list(headers) if isinstance(headers, dict) else [name for name, _ in headers]


def _repartition_failed(message: str, code: str, topic: str) -> ConsumerFailed:
    return ConsumerFailed(
        f"the runner stops: repartition topic {topic!r}: {message}", code=code, setting=SETTING, topic=topic
    )


def ensure_topic(
    kafka: dict[str, Any],
    source: str,
    topic: str,
    *,
    group_id: str,
    grace_s: float,
    log: Callable[[str], None],
) -> int:
    """Make sure ``topic`` exists with ``source``'s partition count (created with its replication when
    it does not); returns that count. Blocking: run it on a thread. ``kafka``: the client properties.

    ``source`` may be unknown for a while (created moments before, its metadata not yet everywhere):
    it is waited for ``grace_s`` and then the runner stops, as it would on the consumer's report
    (``runner.consumer_errors.topic_missing``). A broker that does not answer is waited for; an error
    no retry can fix (a refused login or TLS handshake) stops the runner as the consumer's would
    (``runner.consumer_errors.classify``). A repartition topic with another partition count is
    refused: partition ``p`` of both topics must hold the same shoppers."""
    bootstrap = str(kafka.get("bootstrap.servers", ""))
    if TOPIC_NAME.fullmatch(topic) is None or topic == source:
        raise _repartition_failed(
            f"not a topic name of its own (letters, digits, '.', '_', '-'; not the event topic {source!r})",
            "INVALID_TOPIC",
            topic,
        )
    errors: deque[KafkaError] = deque()
    admin = AdminClient({**kafka, "error_cb": errors.append})  # type: ignore[dict-item]
    try:
        first_unknown: float | None = None
        while True:
            try:
                topics = admin.list_topics(timeout=5).topics
                unanswered = None
            except KafkaException as exc:
                if exc.args and isinstance(exc.args[0], KafkaError):
                    errors.append(exc.args[0])
                unanswered = str(exc)
            if unanswered is not None:  # out of the except: see the finally below
                admin.poll(0)  # serves error_cb: a TLS or login refusal is reported only there
                while errors:
                    error = errors.popleft()
                    if classify(error) in ("fatal", "denied"):
                        raise consumer_failed(error, topic=source, group_id=group_id, bootstrap=bootstrap)
                log(f"repartition topic: the broker did not answer ({unanswered}); waiting")
                time.sleep(METADATA_WAIT_S)
                continue
            found = topics.get(source)
            if found is not None and found.error is None and found.partitions:
                break
            now = time.monotonic()
            first_unknown = now if first_unknown is None else first_unknown
            if now - first_unknown >= grace_s:
                raise topic_missing(source, bootstrap, now - first_unknown)
            time.sleep(METADATA_WAIT_S)
        partitions = len(found.partitions)
        held = topics.get(topic)
        if held is None or held.error is not None:
            replicas = max(1, min(len(p.replicas) for p in found.partitions.values()))
            future = admin.create_topics([NewTopic(topic, partitions, replicas)])[topic]
            try:
                future.result(timeout=30)
                log(f"repartition topic {topic} created: {partitions} partitions, replication {replicas}")
            except KafkaException as exc:
                refusal = exc.args[0] if exc.args else None
                if not isinstance(refusal, KafkaError) or refusal.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise _repartition_failed(
                        f"could not be created ({exc}); create it with {partitions} partitions "
                        f"(as {source}), or allow this user to create it",
                        refusal.name() if isinstance(refusal, KafkaError) else "CREATE_FAILED",
                        topic,
                    ) from None
            return partitions
        if len(held.partitions) != partitions:
            raise _repartition_failed(
                f"has {len(held.partitions)} partitions, {source} has {partitions}: they must be equal "
                "(add partitions to the smaller one)",
                "PARTITION_COUNT",
                topic,
            )
        return partitions
    finally:
        # AdminClient has no close(): librdkafka stops only when the last reference goes, and an
        # exception raised here holds the client two ways: its traceback holds this frame (so the del),
        # and one raised inside ``except KafkaException`` holds that exception as its __context__
        # (``from None`` only hides it), whose traceback holds list_topics' frame and so ``self``.
        # Either way the client outlived the failed start for as long as the caller kept the error,
        # reconnecting to the broker (and logging each refusal) until the process ended.
        del admin


class Repartitioner:
    def __init__(
        self,
        producer: Producer,
        topic: str,
        log: Callable[[str], None],
        *,
        deliver_max_wait_s: float,
        failure: Callable[[], BaseException | None] = lambda: None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.log = log
        self.deliver_max_wait_s = deliver_max_wait_s
        self.failure = failure
        """The runner's failure, if it has failed: a copy waiting for room in a full queue gives up then."""
        self.failed = 0
        """Copies whose delivery failed since the last ``deliver`` (that durable point fails)."""
        self._pending = PendingDeliveries()

    async def send(self, message: Message, event: ShopperEvent) -> None:
        """Queue the copy of ``message`` keyed by its shopper id; never blocks the loop. While the local
        queue is full (the repartition topic's leader away) it waits for room, until the runner fails
        (its durable point gives up on the copies queued before, ``RekeyUndelivered``): then it raises
        that failure, the poll is left unapplied and uncommitted, and the ingest stops. It had waited on,
        ignoring the failure, until librdkafka expired the queued copies (``message.timeout.ms``, 300 s),
        and the runner's exit waited as long."""
        _, timestamp_ms = message.timestamp()
        origin = f"{message.topic()}:{message.partition()}:{message.offset()}".encode()
        headers: list[tuple[str, Any]] = [(REKEYED_FROM, origin)]  # not the original's: see the module
        while True:
            try:
                self._pending.produce(
                    self.producer,
                    self.topic,
                    key=event.shopper_id.encode(),
                    value=message.value(),
                    headers=headers,
                    timestamp=max(0, timestamp_ms),
                    on_delivery=self._report,
                )
                return
            except BufferError:  # the local queue is full: let deliveries free room
                if (failure := self.failure()) is not None:
                    raise failure from None
                self.producer.poll(0)
                await asyncio.sleep(QUEUE_FULL_WAIT_S)

    def behind(self, consumer: Consumer, source: str, assignment: Iterable[TopicPartition]) -> int:
        """Records not processed yet, for ``until_drained``: on the event topic ``source`` and on the
        repartition topic (``pipeline.topic_ends.topic_lag`` of each, with this member's partitions of
        that topic only), plus copies not yet acknowledged (a copy still in the producer's queue is on
        neither topic yet, and a runner that stopped then would leave it unapplied). Blocking."""
        owned = list(assignment)
        unread = len(self.producer)
        for topic in (source, self.topic):
            unread += topic_lag(consumer, topic, [tp for tp in owned if tp.topic == topic])
        return unread

    def _report(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.failed += 1
            self.log(f"re-keyed copy NOT delivered to {self.topic}: {error}")

    async def deliver(self, *, poll_s: float = 5.0) -> None:
        """Until every copy queued before this call is acknowledged. A copy the broker refused (past
        librdkafka's own retries) raises ``RekeyUndelivered``, as does a wait past
        ``deliver_max_wait_s``: nothing past its original may be committed, and a restart replays the
        original and sends it again."""
        generation = self._pending.close_generation()  # the copies sent from now on are the next one's
        started = time.monotonic()
        while await asyncio.to_thread(self._pending.wait, self.producer, generation, poll_s):
            if time.monotonic() - started >= self.deliver_max_wait_s:
                raise RekeyUndelivered(
                    f"re-keyed events not delivered to {self.topic} within {self.deliver_max_wait_s:.0f} s "
                    "(RUNNER_SINK_RETRY__MAX_WAIT_S); nothing past them was committed"
                )
        if self.failed:
            failed, self.failed = self.failed, 0
            raise RekeyUndelivered(
                f"{failed} re-keyed event(s) refused by {self.topic}; nothing past them was committed"
            )


class Delivery(Protocol):
    async def deliver(self) -> None: ...


class Deliveries:
    """Several producers' deliveries as the one ``DeadLetterQueue`` step of ``pipeline.checkpoint``:
    the dead letters and the re-keyed copies, each waited for before anything is committed."""

    def __init__(self, *queues: Delivery) -> None:
        self.queues = queues

    async def deliver(self) -> None:
        for queue in self.queues:
            await queue.deliver()
