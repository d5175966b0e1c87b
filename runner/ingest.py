"""Records in: the poll loop, what the consumer reports, backpressure, and each poll turned into an
epoch of session changes and launched prompts.

Owns the consumer's settings and error intake (``error_cb``), the unknown-topic watch, the
backpressure pause and the drain check (``until_drained``). A shopper's events are applied in the
order of their partition (one consumer per group member, a shopper's events share a partition).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar, cast

from confluent_kafka import KafkaError, KafkaException, Message

from pipeline.kafka_security import librdkafka_properties
from prompt_assembly.events import MalformedEvent, ShopperEvent, parse_events
from runner.consumer_errors import UNKNOWN_TOPIC, UnknownTopicWatch, classify, consumer_failed, topic_missing
from runner.epochs import Epoch
from runner.errors import ConsumerFailed, SessionStoreUnavailable
from runner.prompt_intake import launch_prompts
from runner.repartition import misplaced
from runner.session_store import cache_stored

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner

T = TypeVar("T")

STORE_WAIT_POLL_S = 0.5
"""How often the poll loop polls (its partitions paused) while it waits for the session store: well
inside any ``max.poll.interval.ms``, and rare enough to cost nothing."""
STORE_WAIT_BEFORE_PAUSE_S = 1.0
"""How long a wait for the session store runs before the partitions are paused to poll on. Pausing
drops the records librdkafka has fetched ahead, fetched again on resume, so it is for an outage, not
for a load that is merely slow: one over a store 25 ms away, or a cold start's large replies, took
longer than the poll timeout (50 ms) it waited before, and paused on nearly every poll. Well inside
any ``max.poll.interval.ms``; a rebalance meanwhile waits this long for its callback, twice where a
poll waits twice (its ownership check, then its load)."""


def read_poll(
    messages: list[Message], topic: str, offsets: dict[tuple[str, int], int]
) -> tuple[list[bytes | None], list[tuple[int, int]], list[int]]:
    """A poll's values, timestamps and partitions in one pass, and into ``offsets`` the offset after
    the last record of each (topic, partition) it holds. The runner reads the events topic and the
    repartition topic, and is assigned partition p of both together: keyed by partition alone, one
    topic's offset was left out of a poll that held both (``topic``: a record's when it names none)."""
    values: list[bytes | None] = []
    stamps: list[tuple[int, int]] = []
    partitions: list[int] = []
    last: dict[tuple[str, int], int] = {}  # (topic, partition) -> index of its last record
    for i, message in enumerate(messages):
        partition = message.partition() or 0
        last[(message.topic() or topic, partition)] = i
        values.append(message.value())
        stamps.append(message.timestamp())
        partitions.append(partition)
    for topic_partition, i in last.items():
        offsets[topic_partition] = (messages[i].offset() or 0) + 1
    return values, stamps, partitions


class Ingest:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.kafka_errors: deque[KafkaError] = deque()
        """Errors librdkafka reported through ``error_cb`` (on the consumer thread), not yet looked at."""
        self._unknown_topic = UnknownTopicWatch(self.settings.unknown_topic_grace_s)
        self.paused = False
        """The assigned partitions are paused by backpressure."""
        self._last_message_at = time.monotonic()
        self._held: list[Message] = []
        """Records a poll returned while the loop waited for the store: processed with the next poll,
        if the assignment they were fetched under (``_held_lease``) is still the current one."""
        self._held_lease = 0
        self.not_drained_because: str | None = None
        """With ``until_drained``, what the last drain check waited for (the progress line shows it, so
        a run that never ends says why)."""

    def consumer_config(self) -> dict[str, object]:
        s = self.settings
        return {
            "bootstrap.servers": s.bootstrap_servers,
            "group.id": s.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": s.kafka_session_timeout_ms,
            "heartbeat.interval.ms": max(250, s.kafka_session_timeout_ms // 6),
            "max.poll.interval.ms": max(s.kafka_max_poll_interval_ms, s.kafka_session_timeout_ms),
            "fetch.wait.max.ms": s.kafka_fetch_wait_max_ms,
            "enable.partition.eof": False,
            "log.connection.close": False,
            "allow.auto.create.topics": False,  # a wrong topic name fails (ConsumerFailed), never creates one
            "error_cb": self.kafka_errors.append,  # without it librdkafka's own errors reach no one
            **librdkafka_properties(s.kafka_security),
        }

    async def run(self) -> None:
        """Poll until stopping (or, with ``until_drained``, caught up)."""
        runner, s = self.runner, self.settings
        while not runner.stopping:
            await self._apply_backpressure()
            try:
                messages = await asyncio.to_thread(
                    runner.consumer.consume, s.batch_max_events, s.poll_timeout_s
                )
            except KafkaException as exc:  # consume raises only what it cannot go on from
                error = exc.args[0] if exc.args else None
                runner.fail(self._consumer_failed(error) if isinstance(error, KafkaError) else exc)
                return
            records = self._records(messages)
            if self._held:
                records = self._take_held() + records
            if self._unknown_topic.due(time.monotonic()):
                await self._recheck_topic()
            if runner.failure is not None:
                return
            if records:
                self._unknown_topic.clear()
                if runner.stats.first_event_at is None:
                    runner.stats.first_event_at = time.monotonic()
                try:
                    await self._process(records)
                except SessionStoreUnavailable as exc:
                    runner.fail(exc)
                    return
                except KafkaException as exc:  # a poll while waiting for the store (as above)
                    error = exc.args[0] if exc.args else None
                    runner.fail(self._consumer_failed(error) if isinstance(error, KafkaError) else exc)
                    return
                self._last_message_at = runner.stats.last_event_at = time.monotonic()
                self.not_drained_because = None
            elif s.until_drained and await self._caught_up():
                return

    def _records(self, messages: list[Message]) -> list[Message]:
        """The records among ``messages``; every error among them, and every error librdkafka
        reported through ``error_cb`` since the last poll, is classified (``runner.consumer_errors``):
        one no retry can fix fails the runner, an unknown topic starts the grace period, the rest are
        logged and waited out (librdkafka reconnects)."""
        records = []
        for message in messages:
            error = message.error()
            if error is None:
                records.append(message)
            else:
                self._on_kafka_error(error)
        while self.kafka_errors:
            self._on_kafka_error(self.kafka_errors.popleft())
        return records

    def _on_kafka_error(self, error: KafkaError) -> None:
        kind = classify(error)
        if kind == "ignored":
            return
        if kind in ("fatal", "denied"):
            self.runner.fail(self._consumer_failed(error))
            return
        if kind == "unknown_topic":
            self._unknown_topic.reported(time.monotonic())
        self.runner.log(f"kafka error: {error}")

    def _consumer_failed(self, error: KafkaError) -> ConsumerFailed:
        s = self.settings
        return consumer_failed(error, topic=s.topic, group_id=s.group_id, bootstrap=s.bootstrap_servers)

    async def _recheck_topic(self) -> None:
        """The topic was reported unknown ``unknown_topic_grace_s`` ago: ask the broker again. Still
        unknown: the runner fails; known now (its metadata was late): the watch ends. A broker that
        does not answer is away, which is waited for: it is asked again after the next poll."""
        topic = self.settings.topic
        try:
            metadata = await asyncio.to_thread(self.runner.consumer.list_topics, topic, 5.0)
        except KafkaException:
            return
        found = metadata.topics.get(topic)
        error = None if found is None else found.error
        if found is None or (error is not None and error.code() in UNKNOWN_TOPIC):
            waited = self._unknown_topic.waited(time.monotonic())
            self.runner.fail(topic_missing(topic, self.settings.bootstrap_servers, waited))
        elif error is not None and classify(error) in ("fatal", "denied"):
            self.runner.fail(self._consumer_failed(error))
        else:
            self._unknown_topic.clear()

    async def _process(self, messages: list[Message]) -> None:
        """One poll as one epoch, in passes over the whole poll rather than one pass of every step per
        record: the records' offsets and values, the gate on all of them at once
        (``prompt_assembly.events.parse_events``), the rejected and misplaced records sent on, the
        missing sessions loaded in one round trip, then every event applied in partition order. The
        counts are added once per poll. Per record, only what must be per record stays: the gate, the
        session step, and the offset. A runner whose input is prompts launches them as they are
        (``runner.prompt_intake``)."""
        runner = self.runner
        if self.settings.input == "prompts":
            await launch_prompts(runner, messages)
            return
        acct = runner.stats.accounting
        sessions = runner.sessions
        epoch = Epoch(lease=runner.assignment.lease)  # read after the poll: its records' assignment
        values, stamps, partitions = read_poll(messages, self.settings.topic, epoch.offsets)
        acct.consumed += len(messages)
        times = [ms / 1000.0 if kind != 0 and ms > 0 else None for kind, ms in stamps]
        gated = parse_events(values, times, runner.event_window)
        parsed: list[int] = []
        for i, event in enumerate(gated):
            if isinstance(event, MalformedEvent):
                acct.dead_lettered += 1
                await runner.dead_letters.publish(messages[i], event.reason)
            elif misplaced(messages[i], event):  # its copy, keyed by shopper id, is the one applied
                acct.rekeyed += 1
                await runner.rekeyer.send(messages[i], event)
            else:
                parsed.append(i)
        runner.dead_letters.producer.poll(0)
        runner.rekeyer.producer.poll(0)
        events = cast("list[ShopperEvent]", gated)  # at the indices in ``parsed``
        shoppers = {events[i].shopper_id for i in parsed}
        # The lease's first poll of a partition takes its token before any load (runner.ownership).
        polled = {partition for _, partition in epoch.offsets}
        if not runner.ownership.holds(polled, epoch.lease) and not await self.polling_while(
            runner.ownership.ensure(polled, epoch.lease)
        ):
            acct.consumed -= len(parsed)  # handed over meanwhile: the next owner replays these records
            return
        missing = sessions.missing(shoppers)
        if missing:
            with sessions.pinned(shoppers):  # a durable point during the load must not evict them
                loaded = await self.polling_while(runner.load_sessions(missing))
                if runner.assignment.lease != epoch.lease:
                    # Handed over during the load: the next owner replays these records, and sessions
                    # kept here would be stale if the partitions came back. Nothing of them is kept.
                    acct.consumed -= len(parsed)
                    return
                sessions.adopt(loaded)
        # From here to close_epoch nothing awaits, so no durable point can evict these sessions.
        apply, new_session, launch = (
            runner.processor.apply,
            runner.processor.new_session,
            runner.prompts.launch,
        )
        held = sessions.lookup
        touched: dict[str, int] = {}
        accepted = 0
        for i in parsed:
            event = events[i]
            sid = event.shopper_id
            session = held(sid)
            if session is None:
                session = sessions.use(sid, partitions[i], new_session)
            applied = apply(session, event, values[i])
            if applied.outcome == "accepted":
                accepted += 1
                added = session.entries[-1]  # the event's entry, unless it arrived late (then: the save)
                if added.event is event:
                    cache_stored(added)
            if applied.prompts:
                ts = stamps[i][1] / 1000.0
                for prompt in applied.prompts:
                    launch(prompt, epoch, ts)
            touched[sid] = partitions[i]
        acct.accepted += accepted
        acct.duplicates += len(parsed) - accepted
        sessions.place_many(touched)
        runner.close_epoch(epoch, set(touched))  # from here on the epoch keeps them (busy)

    async def polling_while(self, wait: Awaitable[T]) -> T:
        """``wait`` (a load that may wait out a Redis outage under ``sink_retry``), polling on all the
        while with the assigned partitions paused: a poll then returns no record, but it keeps this
        member in the group (``max.poll.interval.ms``; a member that stopped polling for the minute a
        Redis restart can take left the group, and its partitions moved) and serves rebalances. A
        rebalance meanwhile is seen by the caller (``Assignment.lease``)."""
        runner = self.runner
        task = asyncio.ensure_future(wait)
        try:
            await asyncio.wait({task}, timeout=max(self.settings.poll_timeout_s, STORE_WAIT_BEFORE_PAUSE_S))
        except BaseException:  # cancelled: the wait goes too, as it does once paused
            task.cancel()
            raise
        if task.done():
            return task.result()
        runner.stats.long_wait_pauses += 1
        paused = list(runner.assignment.partitions)
        await asyncio.to_thread(runner.consumer.pause, paused)  # off the loop: see _apply_backpressure
        try:
            while not task.done():
                # A paused partition's fetched records are dropped and fetched again on resume, so a
                # poll here returns none of them; errors and rebalance callbacks still come.
                messages = await asyncio.to_thread(runner.consumer.consume, 1, self.settings.poll_timeout_s)
                self._hold(self._records(messages))  # only once a rebalance meanwhile resumed the partitions
                if not task.done():
                    await asyncio.wait({task}, timeout=STORE_WAIT_POLL_S)
        finally:
            if not task.done():
                task.cancel()
            current = runner.assignment.partitions  # a rebalance meanwhile resumed its own
            if not self.paused and current:
                await asyncio.to_thread(runner.consumer.resume, current)
        return task.result()

    def _hold(self, records: list[Message]) -> None:
        """Keep ``records``, fetched while the loop waits for the store, for the next poll. The
        partitions are paused then, but a rebalance meanwhile assigns and resumes them, and its records
        come. Those held from an earlier assignment are dropped: a later rebalance handed it over (the
        assignment is eager, ``range``), so the partitions still here fetch them again from the
        committed offsets, and the rest belong to another member now. Kept, they were applied twice or
        applied here for a shopper another member owns."""
        lease = self.runner.assignment.lease
        if lease != self._held_lease:
            self._held, self._held_lease = [], lease
        self._held.extend(records)

    def _take_held(self) -> list[Message]:
        """The held records, if the assignment they were fetched under is current; else none (see
        ``_hold``)."""
        held, self._held = self._held, []
        return held if self._held_lease == self.runner.assignment.lease else []

    @property
    def held_records(self) -> int:
        """Records held for the next poll (``_hold``)."""
        return len(self._held)

    async def _apply_backpressure(self) -> None:
        """Pause or resume reading by the prompts in flight. The consumer calls go on a thread: while
        a synchronous commit waits on an unreachable coordinator, librdkafka's Python consumer blocks
        every other call on it, and on the loop one would freeze the runner until the broker is back."""
        runner = self.runner
        limit = self.settings.max_in_flight_prompts
        partitions = runner.assignment.partitions
        # Prompts waiting at the admission gate (latest wins) do not count, up to max_waiting_prompts:
        # a newer trigger can replace one only if the consumer keeps reading.
        waiting = min(runner.enricher.gate.waiting, self.settings.max_waiting_prompts)
        pressure = runner.prompts.in_flight - waiting
        if not self.paused and pressure >= limit and partitions:
            await asyncio.to_thread(runner.consumer.pause, partitions)
            self.paused = True
            runner.stats.paused_times += 1
        elif self.paused and pressure <= limit // 2:
            await asyncio.to_thread(runner.consumer.resume, partitions)
            self.paused = False

    async def _caught_up(self) -> bool:
        self.not_drained_because = reason = await self._drain_blocker()
        return reason is None

    async def _drain_blocker(self) -> str | None:
        """What keeps the run from being drained now (``None``: drained)."""
        runner = self.runner
        partitions = runner.assignment.partitions
        if not partitions:
            return "no partitions assigned"
        if runner.prompts.in_flight:
            return f"{runner.prompts.in_flight} prompts in flight"
        if self.paused:
            return "paused by backpressure"
        if runner.handover.rearming:  # its timers are not armed yet: draining now would never fire them
            return "re-arming timers of assigned partitions"
        if time.monotonic() - self._last_message_at < self.settings.drain_idle_s:
            return f"quiet for less than drain_idle_s ({self.settings.drain_idle_s:g} s)"
        try:
            # the event topic, the repartition topic and copies not yet delivered (runner.repartition)
            lag = await asyncio.to_thread(
                runner.rekeyer.behind, runner.consumer, self.settings.topic, partitions
            )
        except KafkaException as exc:  # the broker is away: not caught up, keep consuming (it waits)
            return f"lag unknown ({exc})"
        return None if lag == 0 else f"{lag} records behind"
