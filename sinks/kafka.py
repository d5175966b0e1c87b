"""Results onto a Kafka topic (``insights_topic``), for consumers other than Redis and S3.

Each record is a result's JSON (``model_dump_json``: the bytes the Flink job's insights topic carries),
keyed by ``shopper_id`` so that one shopper's results land in one partition, placed by murmur2 of the
key as Java clients place them, so the Flink job's keyed sink puts a shopper on the same partition
(docs/flink.md, "What the engines write"). ``write`` only queues records in librdkafka (which sends
them in the background, idempotently, so its own retries keep a partition's order); ``flush`` waits for
the delivery report of every record written before it began and raises ``SinkWriteFailed`` while any
of them is undelivered, sending the refused ones again first, so a durable point never passes a result
the topic does not hold. It does not wait for the records written meanwhile (the engine's calls land
at any time; ``sinks.deliveries``). At-least-once: a retried flush can deliver a result twice, or
after a later result of the same shopper; consumers dedupe on ``request_id`` and order a shopper's
results by their version ``(session_epoch, seq)``, as the Redis sink does (docs/contracts.md).

A result whose record is over Kafka's size limit (the producer's ``message.max.bytes``, refused in
``produce``; or the broker's or topic's, refused in its delivery report) can never be written, so it is
not retried: it becomes a ``ResultTooLarge`` naming it, its size and the limit, counted (``too_large``),
logged and kept (``too_large_recent``), and the stream goes on, as the runner's dead letters do with a
record the DLQ refuses (``runner.dead_letters``). The topic then lacks that result; Redis and S3 hold it.
The session's own bounds (``prompt_assembly.events``: event ids, trims) keep results well under
librdkafka's default 1,000,000 bytes, so this takes a lowered limit or an outsized answer.

librdkafka blocks nothing here: produce never waits (a full queue is polled from a thread until it has
room), and ``flush`` runs off the event loop. Delivery reports arrive on the thread that polls; they only
append to lists, which the loop reads after that thread is done.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import orjson
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from prompt_assembly.records import EnrichmentResult
from sinks.deliveries import PendingDeliveries
from sinks.errors import ResultTooLarge, SinkWriteFailed

log = logging.getLogger(__name__)

FULL_QUEUE_POLL_S = 0.05
TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE})
"""librdkafka's codes for a record over a size limit: its own (in ``produce``) or the broker's."""
LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000
"""librdkafka's default ``message.max.bytes``, the limit when the engine's properties set none."""
TOO_LARGE_KEPT = 100
"""The latest ``ResultTooLarge`` kept for inspection; the count covers all of them."""


class KafkaResultSink:
    name = "kafka"

    def __init__(
        self, topic: str, producer_config: Mapping[str, object], *, flush_timeout_s: float = 10.0
    ) -> None:
        """``producer_config``: librdkafka properties of the engine's cluster (bootstrap servers,
        TLS/SASL); ``flush_timeout_s``: one ``flush`` waits this long before it reports what is left
        (the engine's retry policy decides how long to keep trying)."""
        self.topic = topic
        self.flush_timeout_s = flush_timeout_s
        config: dict[str, object] = {
            "linger.ms": 20,
            "log.connection.close": False,
            "enable.idempotence": True,  # librdkafka's own retries keep a partition's order
            "partitioner": "murmur2_random",  # Java's default partitioner (the Flink job's), not CRC32
            **dict(producer_config),
        }
        self._producer = Producer(config)
        self.message_max_bytes = int(str(config.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)))
        self._refused: list[tuple[bytes, bytes]] = []
        self._refused_for_size: list[tuple[bytes, bytes]] = []
        self._errors: list[KafkaError] = []
        self.delivered = 0
        self.too_large = 0
        """Results never on the topic: over a size limit (``ResultTooLarge``)."""
        self.too_large_recent: deque[ResultTooLarge] = deque(maxlen=TOO_LARGE_KEPT)
        self._pending = PendingDeliveries()
        self._closed = False
        self._thread_calls = threading.Lock()
        """Held by each producer call run off the loop, and by ``close``."""

    async def open(self) -> None:
        return None

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        for result in results:
            value = result.model_dump_json().encode()
            try:
                await self._produce(result.shopper_id.encode(), value)
            except KafkaException as exc:
                if _code(exc) not in TOO_LARGE:
                    raise
                self._skip_too_large(result.request_id, result.shopper_id, len(value), self.message_max_bytes)
        self._producer.poll(0)
        self._skip_refused_for_size()

    async def _produce(self, key: bytes, value: bytes, generation: int | None = None) -> None:
        while True:
            try:
                self._pending.produce(
                    self._producer,
                    self.topic,
                    value=value,
                    key=key,
                    on_delivery=self._delivered,
                    generation=generation,
                )
                return
            except BufferError:  # the local queue is full: deliveries (or their timeouts) free it
                await asyncio.to_thread(self._in_thread, self._producer.poll, FULL_QUEUE_POLL_S)

    def _delivered(self, error: KafkaError | None, message: Message) -> None:
        if error is None:
            self.delivered += 1
            return
        if error.code() in TOO_LARGE:  # the broker's or the topic's limit: sending it again cannot help
            self._refused_for_size.append((message.key() or b"", message.value() or b""))
            return
        self._errors.append(error)
        self._refused.append((message.key() or b"", message.value() or b""))

    def _skip_too_large(self, request_id: str, shopper_id: str, size: int, limit: int | None) -> None:
        error = ResultTooLarge(
            topic=self.topic, request_id=request_id, shopper_id=shopper_id, size=size, limit=limit
        )
        self.too_large += 1
        self.too_large_recent.append(error)
        log.warning("%s", error)

    def _skip_refused_for_size(self) -> None:
        """Account for the records the broker refused for their size (put aside by delivery reports)."""
        while self._refused_for_size:
            key, value = self._refused_for_size.pop(0)
            request_id = str(orjson.loads(value).get("request_id", "?")) if value else "?"
            self._skip_too_large(request_id, key.decode(errors="replace"), len(value), None)

    def due(self) -> bool:
        return False  # librdkafka sends as it goes; a durable point only waits for the reports

    async def flush(self) -> None:
        # The records written from now on are the next flush's to wait for.
        generation = self._pending.close_generation()
        # Each refused record leaves the list only once it is queued again: a produce that raises (the
        # topic gone, the flush cancelled) keeps the rest, so the next flush cannot pass them by.
        refused, self._refused = self._refused, []
        try:
            while refused:
                await self._produce(*refused[0], generation)
                refused.pop(0)
        except KafkaException as exc:  # the producer refuses at once now: the topic is known to be gone
            error = exc.args[0] if exc.args else exc
            raise SinkWriteFailed(
                f"kafka sink: {len(refused)} refused results could not be sent again to topic "
                f"{self.topic!r} ({error})"
            ) from exc
        finally:
            self._refused[:0] = refused
        left = await asyncio.to_thread(
            self._in_thread, partial(self._pending.wait, self._producer, generation), self.flush_timeout_s
        )
        self._skip_refused_for_size()
        if left or self._refused:
            errors, self._errors = self._errors, []
            reason = str(errors[0]) if errors else f"no delivery report within {self.flush_timeout_s} s"
            raise SinkWriteFailed(
                f"kafka sink: {left} results still queued and {len(self._refused)} refused by topic "
                f"{self.topic!r} ({reason})"
            )
        self._errors.clear()

    async def close(self) -> None:
        """Deliver what is queued (one ``flush_timeout_s``), then close the producer, so its threads and
        broker connections go now and not when the sink is collected (a failed start's traceback holds
        it for as long as the error is held). What is still queued then is past the last durable point,
        so the replay writes it again: it is purged rather than waited out for ``message.timeout.ms``
        (``Producer.close`` alone would wait). A second ``close`` does nothing."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._close_producer)

    def _close_producer(self) -> None:
        with self._thread_calls:  # a flush whose caller was cancelled may still run in its thread
            try:
                self._producer.flush(self.flush_timeout_s)
                self._producer.purge()
            finally:
                self._producer.close()

    def _in_thread(self, call: Callable[[float], int], timeout_s: float) -> int:
        """A blocking producer call, run off the loop; ``close`` waits for it: a confluent-kafka release
        older than the upstream fix that makes ``close`` wait for calls in other threads (2.16.2 has it)
        may free the handle under a call still running in another thread."""
        with self._thread_calls:
            return call(timeout_s)


def _code(exc: KafkaException) -> int | None:
    """The librdkafka error code a ``KafkaException`` carries, if any."""
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None
