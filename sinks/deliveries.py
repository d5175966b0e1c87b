"""Which records a producer was handed before a durable point still lack a delivery report.

A durable point may commit offsets only once every record the records before them caused is on its
topic, so it waits for delivery reports. librdkafka's own ``flush`` waits for an *empty* queue. But the
engine keeps producing while it waits (results land, dead letters and re-keyed copies come with each
poll), and once the broker's round trip is longer than the gap between two records the queue is never
empty: every durable point ran out its time and the runner failed, however healthy the broker
(``tests/sinks/test_sinks.py``, a broker 20 ms away). So records are counted by *generation*: a
durable point closes the current one and waits only for the reports of the records produced in it and
before, the way a watermark waits only for what is older than itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

DeliveryReport = Callable[[KafkaError | None, Message], None]

POLL_S = 0.01
"""A wait serves delivery reports in steps this long, checking between them what it still waits for
(a report served by another thread's poll is seen within it)."""


class PendingDeliveries:
    """Records produced through ``produce`` and not yet reported, by generation. Reports are served on
    whichever thread polls the producer, so the counts are guarded by a lock."""

    def __init__(self) -> None:
        self.generation = 0
        """Records produced now belong to it; ``close_generation`` starts the next one."""
        self._undelivered: dict[int, int] = {}
        self._lock = threading.Lock()

    def close_generation(self) -> int:
        """Starts the next generation; returns the closed one, what a durable point then waits for."""
        closed = self.generation
        self.generation += 1
        return closed

    def produce(
        self,
        producer: Producer,
        topic: str,
        *,
        on_delivery: DeliveryReport | None = None,
        generation: int | None = None,
        **record: Any,
    ) -> None:
        """``producer.produce(topic, **record)``, its report counted in ``generation`` (the current one
        unless given: a record sent again keeps the generation of the one it replaces). Raises what
        ``produce`` raises (``BufferError``, ``KafkaException``), and then counts nothing."""
        counted = self.generation if generation is None else generation
        self._count(counted, 1)  # before the record can be reported, on another thread
        try:
            producer.produce(topic, on_delivery=partial(self._reported, counted, on_delivery), **record)
        except BaseException:
            self._count(counted, -1)
            raise

    def hold(self, generation: int) -> None:
        """Count one more record of ``generation`` that is not handed to the producer yet (one put aside
        to be sent again in place of a refused one): a wait does not end before ``release``."""
        self._count(generation, 1)

    def release(self, generation: int) -> None:
        """A held record is handed to the producer (and counted there) or given up."""
        self._count(generation, -1)

    def undelivered(self, generation: int) -> int:
        """Records of ``generation`` and before without a delivery report yet."""
        with self._lock:
            return sum(count for older, count in self._undelivered.items() if older <= generation)

    def wait(self, producer: Producer, generation: int, timeout_s: float) -> int:
        """Serves delivery reports until every record of ``generation`` and before has one, or
        ``timeout_s`` passes (reports already in are served even at 0, as ``flush(0)`` does); returns
        how many still have none. Blocks: call it off the event loop."""
        deadline = time.monotonic() + timeout_s
        while self.undelivered(generation):
            wait = deadline - time.monotonic()
            # librdkafka's flush, in short steps: it serves the reports, and sends what lingers at once
            # (``linger.ms``), as a durable point wants. It returns early only once the queue is empty.
            producer.flush(max(0.0, min(wait, POLL_S)))  # at least once: at 0 it serves what is in
            if wait <= 0:
                return self.undelivered(generation)
        return 0

    def _reported(
        self, generation: int, on_delivery: DeliveryReport | None, error: KafkaError | None, message: Message
    ) -> None:
        try:  # counted until the report is handled: what it puts aside is held before the count drops
            if on_delivery is not None:
                on_delivery(error, message)
        finally:
            self._count(generation, -1)

    def _count(self, generation: int, change: int) -> None:
        with self._lock:
            left = self._undelivered.get(generation, 0) + change
            if left:
                self._undelivered[generation] = left
            else:
                del self._undelivered[generation]
