"""Repartition by shopper id: an event whose Kafka key is not its shopper id is produced again to the
event topic, keyed by the shopper id, and the copy is what the runner applies.

Why: the runner owns sessions by partition. An unkeyed event (placed at random) or one keyed by
something else (a session id, a device id) lands on a partition another member may own, so two
runners held the same shopper, or its click was applied after the purchase that followed it. Kafka
Streams repartitions before any stateful step, and the Flink job re-keys by ``shopper_id`` in SQL;
this is the runner's equivalent, through the event topic itself (no second topic to create).

Guarantees: the original's offset is committed only after the copy's delivery is acknowledged (the
copies are delivered at every durable point, before the sessions are saved and the offsets committed:
``Deliveries``), so a crash replays the original and produces the copy again; the session drops the
second copy as a duplicate (same ``event_id``). The copy keeps the original's value, headers and
timestamp (so the event-time gate answers the same), and goes to the partition ``rekey_partitioner``
picks for the shopper id: the partitioner of the producers that key correctly (librdkafka's
``consistent_random`` for confluent-kafka, kcat and ``shopper produce``; ``murmur2_random`` for Java
clients). The copy comes after the shopper's events produced meanwhile: it is applied late, as a late
event is (``prompt_assembly.session``). Counted as ``rekeyed`` (``shopper_events_rekeyed_total``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from confluent_kafka import KafkaError, Message, Producer

from prompt_assembly.events import ShopperEvent
from runner.errors import RekeyUndelivered

QUEUE_FULL_WAIT_S = 0.1


def misplaced(message: Message, event: ShopperEvent) -> bool:
    """The record's key is not its event's shopper id (none, or another one)."""
    return message.key() != event.shopper_id.encode()


class Repartitioner:
    def __init__(
        self, producer: Producer, topic: str, log: Callable[[str], None], *, deliver_max_wait_s: float
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.log = log
        self.deliver_max_wait_s = deliver_max_wait_s
        self.failed = 0
        """Copies whose delivery failed since the last ``deliver`` (that durable point fails)."""

    async def send(self, message: Message, event: ShopperEvent) -> None:
        """Queue the copy of ``message`` keyed by its shopper id; never blocks the loop."""
        _, timestamp_ms = message.timestamp()
        while True:
            try:
                self.producer.produce(
                    self.topic,
                    key=event.shopper_id.encode(),
                    value=message.value(),
                    headers=message.headers(),
                    timestamp=max(0, timestamp_ms),
                    on_delivery=self._report,
                )
                return
            except BufferError:  # the local queue is full: let deliveries free room
                self.producer.poll(0)
                await asyncio.sleep(QUEUE_FULL_WAIT_S)

    def _report(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.failed += 1
            self.log(f"re-keyed copy NOT delivered to {self.topic}: {error}")

    async def deliver(self, *, poll_s: float = 5.0) -> None:
        """Until every queued copy is acknowledged. A copy the broker refused (past librdkafka's own
        retries) raises ``RekeyUndelivered``, as does a wait past ``deliver_max_wait_s``: nothing past
        its original may be committed, and a restart replays the original and sends it again."""
        started = time.monotonic()
        while await asyncio.to_thread(self.producer.flush, poll_s):
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
