"""The embedded runner: a thin engine shell on a Kafka consumer group (confluent-kafka).

It only delivers: records in, each shopper's events in order to the engine-free step
(``SessionProcessor``), prompts to the enrichment step, results to the sinks, progress made durable.
The parts it is built from each have one job: ``epochs`` (what may be committed), ``timers`` (pending
triggers on the wall clock), ``dead_letters`` (a DLQ that cannot stop the stream), ``session_store``
(sessions in Redis), ``progress`` (counters and the progress line), ``metrics``/``health``/``ops_server``
(Prometheus ``/metrics`` and ``/health``), ``logs`` (text or JSON lines). The dead-letter record, the
enrichment step, the sink retry policy and the commit protocol (``pipeline.checkpoint.Checkpoint``)
are the shared ``pipeline`` layer the Flink job calls too; the sinks are those ``SinkSettings.enabled``
names, built by ``sinks.registry``.

Processing guarantees:
- per-partition order: one consumer per group member, and a shopper's events share a partition (key);
- at-least-once, made effectively-once by idempotent sinks: an epoch's session deltas are saved and
  its offsets committed only after every result it caused is durable (every sink flushed, dead
  letters delivered: ``Checkpoint.make_durable``), in epoch order. A crash replays from the last
  commit; replayed events are deduplicated by the restored sessions, and replayed prompts carry the
  same ``request_id``/``seq``;
- a store that is down is waited for (``sink_retry``), never committed past;
- backpressure: beyond ``max_in_flight_prompts`` the assigned partitions are paused (the consumer
  keeps polling, so it stays in the group) and resumed at half that;
- rebalance: revoked partitions are made durable and committed first, waiting at most
  ``revoke_timeout_s`` (past it they are handed over uncommitted and the next owner replays them);
  the pending triggers of assigned partitions are re-armed from the store, never for a partition
  revoked meanwhile;
- SIGTERM drains: no new polls, in-flight prompts finish, one last durable point and commit;
- a consumer error no retry can fix (a fatal error, a refused login or TLS handshake, a topic that
  stays unknown past ``unknown_topic_grace_s``) stops the runner with ``runner.errors.ConsumerFailed``;
  a broker that is away is waited for (``runner.consumer_errors``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from llm_client.client import LLMClient
from pipeline.checkpoint import Checkpoint
from pipeline.enrichment import Enricher
from pipeline.kafka_security import librdkafka_properties
from pipeline.sink_retry import with_sink_retry
from pipeline.topic_ends import topic_lag
from prompt_assembly.events import MalformedEvent, parse_event, record_time_s
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import EnrichmentResult, PromptRequest, ShopperInsight
from prompt_assembly.session import ShopperSession
from runner.config import RunnerSettings
from runner.consumer_errors import UNKNOWN_TOPIC, UnknownTopicWatch, classify, consumer_failed, topic_missing
from runner.dead_letters import DeadLetterPublisher
from runner.epochs import Epoch, EpochLog, merged_offsets
from runner.errors import ConsumerFailed
from runner.gc_tuning import streaming_gc
from runner.logs import line_logger
from runner.metrics import RunnerMetrics
from runner.ops_server import OpsServer
from runner.progress import ProgressLine, RunnerStats
from runner.session_store import RedisSessionStore, SessionDelta
from runner.timers import TimerQueue
from sinks.registry import SinkResources, build_sinks

T = TypeVar("T")

__all__ = ["EmbeddedRunner", "RunnerStats"]


class EmbeddedRunner:
    def __init__(self, settings: RunnerSettings, *, log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.log = log or line_logger(settings.log_format)
        self.processor = SessionProcessor(settings.session)
        self._window = settings.session.event_time
        self.stats = RunnerStats()
        self.epochs = EpochLog()
        self.timers = TimerQueue()
        self._progress_line = ProgressLine(self.stats)
        self._sessions: dict[str, ShopperSession] = {}
        self._partition_of: dict[str, int] = {}
        """The partition of each session in ``_sessions`` (and of no other): bounded with it."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._rearms: set[asyncio.Task[None]] = set()
        self._generation = 0
        """Counts assignments and revocations (written on the consumer thread): a re-arm started for
        one assignment does nothing once it has changed."""
        self._kafka_errors: deque[KafkaError] = deque()
        """Errors librdkafka reported through ``error_cb`` (on the consumer thread), not yet looked at."""
        self._unknown_topic = UnknownTopicWatch(settings.unknown_topic_grace_s)
        self._in_flight = 0
        self._paused = False
        self._stopping = asyncio.Event()
        self._failed: BaseException | None = None
        self._kafka_ts: dict[str, float] = {}
        self._assignment: list[TopicPartition] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_message_at = time.monotonic()
        self._commit_lock = asyncio.Lock()
        self.started_at = time.monotonic()
        self.metrics = RunnerMetrics(self)
        self.ops: OpsServer | None = None
        """``/metrics`` and ``/health`` while running, when ``metrics_port`` is set."""

    # ---- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> RunnerStats:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        redis = s.sinks.redis_client()  # ACL user, password and CA from SinkSettings
        self.store = RedisSessionStore(redis, s.sinks.redis_key_prefix)
        kafka = {"bootstrap.servers": s.bootstrap_servers, **librdkafka_properties(s.kafka_security)}
        producer = Producer({**kafka, "linger.ms": 20, "log.connection.close": False})
        self.dead_letters = DeadLetterPublisher(
            producer,
            s.dlq_topic,
            self.log,
            max_original_bytes=s.dlq_max_original_bytes,
            counts=self.stats.dead_letters,
            deliver_max_wait_s=s.sink_retry.max_wait_s,
        )
        self.checkpoint = Checkpoint(
            build_sinks(s.sinks, SinkResources(redis=redis, kafka=kafka)),
            s.sink_retry,
            dead_letters=self.dead_letters,
            on_retry=self._on_sink_retry,
        )
        try:  # a store still down past the retry policy: nothing was consumed, close what was opened
            await self.checkpoint.open()
        except BaseException:
            await self.checkpoint.close()
            await redis.aclose()
            raise
        self.consumer = Consumer(self._consumer_config())
        self.consumer.subscribe([s.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self.request_stop)
        async with LLMClient(s.llm) as client:
            self.enricher = Enricher(client, s.enrichment)
            self.client = client
            if s.metrics_port is not None:
                self.ops = OpsServer(self, self.metrics, host=s.metrics_host, port=s.metrics_port)
                await self.ops.start()
                self.log(f"metrics and health on {self.ops.address}")
            workers = [
                asyncio.create_task(self._committer(), name="committer"),
                asyncio.create_task(self._timer_loop(), name="timers"),
                asyncio.create_task(self._progress(), name="progress"),
            ]
            try:
                with streaming_gc():  # the per-event objects live on: see runner.gc_tuning
                    await self._ingest()
                await self._drain()
            finally:
                for worker in [*workers, *self._rearms]:
                    worker.cancel()
                for worker in [*workers, *self._rearms]:
                    with contextlib.suppress(asyncio.CancelledError):
                        await worker
                await asyncio.to_thread(self.consumer.close)
                await asyncio.to_thread(self.dead_letters.flush, 10)
                await self.checkpoint.close()
                del self.dead_letters, self.checkpoint  # librdkafka handles go with the last reference
                await redis.aclose()
                if self.ops is not None:
                    await self.ops.stop()
        if self._failed is not None:
            raise self._failed
        self.log(self._render_progress(final=True))
        return self.stats

    def _consumer_config(self) -> dict[str, object]:
        s = self.settings
        return {
            "bootstrap.servers": s.bootstrap_servers,
            "group.id": s.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": s.kafka_session_timeout_ms,
            "heartbeat.interval.ms": max(250, s.kafka_session_timeout_ms // 6),
            "max.poll.interval.ms": max(60_000, s.kafka_session_timeout_ms),
            "enable.partition.eof": False,
            "log.connection.close": False,
            "allow.auto.create.topics": False,  # a wrong topic name fails (ConsumerFailed), never creates one
            "error_cb": self._kafka_errors.append,  # without it librdkafka's own errors reach no one
            **librdkafka_properties(s.kafka_security),
        }

    def request_stop(self) -> None:
        self._stopping.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def undelivered_dead_letters(self) -> int:
        return self.stats.dead_letters.undelivered

    # ---- what metrics and health read (runner.health.RunnerView) ----------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def llm_client(self) -> LLMClient | None:
        return getattr(self, "client", None)

    @property
    def failure(self) -> BaseException | None:
        return self._failed

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def assigned_partitions(self) -> list[int]:
        return sorted(tp.partition for tp in self._assignment)

    # ---- ingest --------------------------------------------------------------------------------
    async def _ingest(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            self._apply_backpressure()
            try:
                messages = await asyncio.to_thread(
                    self.consumer.consume, s.batch_max_events, s.poll_timeout_s
                )
            except KafkaException as exc:  # consume raises only what it cannot go on from
                error = exc.args[0] if exc.args else None
                self._fail(self._consumer_failed(error) if isinstance(error, KafkaError) else exc)
                return
            records = self._records(messages)
            if self._unknown_topic.due(time.monotonic()):
                await self._recheck_topic()
            if self._failed is not None:
                return
            if records:
                self._unknown_topic.clear()
                if self.stats.first_event_at is None:
                    self.stats.first_event_at = time.monotonic()
                await self._process(records)
                self._last_message_at = self.stats.last_event_at = time.monotonic()
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
        while self._kafka_errors:
            self._on_kafka_error(self._kafka_errors.popleft())
        return records

    def _on_kafka_error(self, error: KafkaError) -> None:
        kind = classify(error)
        if kind == "ignored":
            return
        if kind in ("fatal", "denied"):
            self._fail(self._consumer_failed(error))
            return
        if kind == "unknown_topic":
            self._unknown_topic.reported(time.monotonic())
        self.log(f"kafka error: {error}")

    def _consumer_failed(self, error: KafkaError) -> ConsumerFailed:
        s = self.settings
        return consumer_failed(error, topic=s.topic, group_id=s.group_id, bootstrap=s.bootstrap_servers)

    async def _recheck_topic(self) -> None:
        """The topic was reported unknown ``unknown_topic_grace_s`` ago: ask the broker again. Still
        unknown: the runner fails; known now (its metadata was late): the watch ends. A broker that
        does not answer is away, which is waited for: it is asked again after the next poll."""
        topic = self.settings.topic
        try:
            metadata = await asyncio.to_thread(self.consumer.list_topics, topic, 5.0)
        except KafkaException:
            return
        found = metadata.topics.get(topic)
        error = None if found is None else found.error
        if found is None or (error is not None and error.code() in UNKNOWN_TOPIC):
            waited = self._unknown_topic.waited(time.monotonic())
            self._fail(topic_missing(topic, self.settings.bootstrap_servers, waited))
        elif error is not None and classify(error) in ("fatal", "denied"):
            self._fail(self._consumer_failed(error))
        else:
            self._unknown_topic.clear()

    async def _process(self, messages: list[Message]) -> None:
        acct = self.stats.accounting
        epoch = Epoch()
        parsed = []
        for message in messages:
            acct.consumed += 1
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            assert topic is not None and partition is not None and offset is not None  # a real record
            epoch.offsets[(topic, partition)] = offset + 1
            try:
                event = parse_event(message.value(), record_time_s(message.timestamp()), self._window)
                parsed.append((message, event))
            except MalformedEvent as exc:
                acct.dead_lettered += 1
                await self.dead_letters.publish(message, exc.reason)
        self.dead_letters.producer.poll(0)
        missing = list({ev.shopper_id for _, ev in parsed if ev.shopper_id not in self._sessions})
        if missing:
            loaded = await self._retrying(lambda: self.store.load_many(missing), "session load")
            self._adopt(loaded)
        touched: set[str] = set()
        for message, event in parsed:
            sid = event.shopper_id
            session = self._sessions.get(sid)
            if session is None:
                session = self._sessions[sid] = self.processor.new_session(sid)
            self._partition_of[sid] = message.partition() or 0
            applied = self.processor.apply(session, event, message.value())
            if applied.outcome == "accepted":
                acct.accepted += 1
            else:
                acct.duplicates += 1
            ts = message.timestamp()[1] / 1000.0
            for prompt in applied.prompts:
                self._launch(prompt, epoch, ts)
            touched.add(sid)
        self._close_epoch(epoch, touched)

    def _close_epoch(self, epoch: Epoch, touched: set[str]) -> None:
        """Snapshot the touched sessions' changes into ``epoch`` and log it (in order)."""
        for sid in touched:
            session = self._sessions[sid]
            epoch.deltas.append(SessionDelta(sid, self._partition_of.get(sid, 0), session.take_changes()))
            if session.pending is not None:
                self.timers.arm(sid, session.pending.due_ts, self._wall_deadline(session))
        self.epochs.append(epoch)

    def _launch(self, prompt: PromptRequest, epoch: Epoch, kafka_ts: float | None) -> None:
        epoch.pending += 1
        self._in_flight += 1
        self.stats.accounting.prompts += 1
        self.stats.estimated_prompt_tokens += prompt.prompt_tokens
        self.stats.estimated_shared_tokens += prompt.shared_prefix_tokens
        if kafka_ts:
            self._kafka_ts[prompt.request_id] = kafka_ts
        task = asyncio.create_task(self._enrich(prompt, epoch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _enrich(self, prompt: PromptRequest, epoch: Epoch) -> None:
        try:
            result = await self.enricher.enrich(prompt)  # never raises: an error is a result too
            await self._store_result(result)
        except Exception as exc:  # a store stayed down past sink_retry: stop without committing
            self._fail(exc)
            return
        finally:
            self._in_flight -= 1
        epoch.pending -= 1

    async def _store_result(self, result: EnrichmentResult) -> None:
        await self.checkpoint.write([result])  # buffering sinks are flushed at the durable point
        acct = self.stats.accounting
        if isinstance(result, ShopperInsight):
            acct.insights += 1
            self.stats.prompt_tokens += result.usage.prompt_tokens
            self.stats.cached_tokens += result.usage.cached_tokens
        else:
            acct.errors += 1
            self.log(f"error record {result.request_id}: {result.error_type}: {result.message[:160]}")
        produced = self._kafka_ts.pop(result.request_id, None)
        freshness_ms = None if produced is None else (time.time() - produced) * 1000
        if freshness_ms is not None:
            self.stats.freshness_ms.append(freshness_ms)
        self.metrics.observe_result(result, freshness_ms)

    async def _retrying(self, write: Callable[[], Awaitable[T]], what: str) -> T:
        return await with_sink_retry(write, self.settings.sink_retry, what=what, on_retry=self._on_sink_retry)

    def _on_sink_retry(self, what: str, exc: BaseException) -> None:
        self.stats.sink_retries += 1
        if self.stats.sink_retries % 20 == 1:
            self.log(f"{what} failed, retrying: {exc!r}")

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
            self.log(f"runner failing, nothing more will be committed: {exc!r}")
        self._stopping.set()

    def _apply_backpressure(self) -> None:
        limit = self.settings.max_in_flight_prompts
        if not self._paused and self._in_flight >= limit and self._assignment:
            self.consumer.pause(self._assignment)
            self._paused = True
            self.stats.paused_times += 1
        elif self._paused and self._in_flight <= limit // 2:
            self.consumer.resume(self._assignment)
            self._paused = False

    async def _caught_up(self) -> bool:
        if not self._assignment or self._in_flight or self._paused:
            return False
        if time.monotonic() - self._last_message_at < self.settings.drain_idle_s:
            return False
        try:
            return (
                await asyncio.to_thread(topic_lag, self.consumer, self.settings.topic, self._assignment) == 0
            )
        except KafkaException:  # the broker is away: not caught up, keep consuming (it waits)
            return False

    # ---- timers --------------------------------------------------------------------------------
    def _wall_deadline(self, session: ShopperSession) -> float:
        assert session.pending is not None
        wait = max(0.0, session.pending.due_ts - session.last_event_ts)
        return self.timers.now() + wait * self.settings.timer_wall_per_event_s

    async def _timer_loop(self) -> None:
        while True:
            fired: set[str] = set()
            epoch = Epoch()
            for sid, due_ts in self.timers.pop_due():
                session = self._sessions.get(sid)
                if session is None:
                    continue
                prompts = self.processor.fire_pending(session, due_ts)
                for prompt in prompts:
                    self._launch(prompt, epoch, None)
                if prompts:
                    fired.add(sid)
            if fired:
                self._close_epoch(epoch, fired)
            await self.timers.wait()

    def _start_rearm(self, generation: int, partitions: list[int]) -> None:
        """On the loop, for ``_on_assign``: re-arming runs in a task the runner keeps, so that its
        failure fails the runner like any other worker's, and a revoke can cancel it."""
        task = asyncio.create_task(self._rearm(generation, partitions), name=f"rearm {partitions}")
        self._rearms.add(task)
        task.add_done_callback(functools.partial(self._rearm_done, partitions))

    def _rearm_done(self, partitions: list[int], task: asyncio.Task[None]) -> None:
        self._rearms.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.log(f"re-arming the timers of partitions {partitions} failed: {exc!r}")
            self._fail(exc)

    def _cancel_rearms(self) -> None:
        for task in self._rearms:
            task.cancel()

    async def _rearm(self, generation: int, partitions: list[int]) -> None:
        """Arm the pending triggers the store holds for newly assigned ``partitions``. Each await can
        span a rebalance; once the assignment this was started for has changed (``_generation``),
        nothing more is armed or cached: the partitions' next owner re-arms them, and timers or sessions
        held here would fire prompts and save sessions for partitions this member no longer owns."""

        def revoked() -> bool:
            return self._generation != generation

        for partition in partitions:
            if revoked():
                return
            timers = await self._retrying(functools.partial(self.store.timers, partition), "timer load")
            if revoked():
                return
            sids = [sid for sid, _ in timers if sid not in self._sessions]
            loaded = await self._retrying(functools.partial(self.store.load_many, sids), "session load")
            if revoked():
                return
            self._adopt(loaded)
            for sid, wall in timers:
                session = self._sessions.get(sid)
                if session is not None and session.pending is not None:
                    self._partition_of[sid] = partition
                    self.timers.arm(sid, session.pending.due_ts, wall)

    def _adopt(self, loaded: dict[str, ShopperSession]) -> None:
        """Sessions loaded from the store, for shoppers not in memory *now*: a load awaits, and the
        other loader (ingest or re-arming timers after an assignment) may have loaded the same shopper
        and applied events to it meanwhile. Replacing that session with the stale copy lost those
        events' changes (prompts went missing after a rebalance: the rebalance case of
        tests/faults/test_faults.py)."""
        for sid, session in loaded.items():
            self._sessions.setdefault(sid, session)

    # ---- durability ----------------------------------------------------------------------------
    async def _committer(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            try:
                await self._commit_durable()
            except Exception as exc:
                self._fail(exc)
                return

    async def _commit_durable(self) -> None:
        """The one commit path: make the completed prefix durable, then commit its offsets."""
        offsets = await self._durable_point()
        if offsets:
            await self.checkpoint.commit(
                functools.partial(self._commit_offsets, offsets),
                on_fenced=lambda exc: self.log(f"commit skipped, the group is rebalancing: {exc}"),
            )

    def _commit_offsets(self, offsets: list[TopicPartition]) -> None:
        self.consumer.commit(offsets=offsets, asynchronous=False)
        self.stats.commits += 1
        self.stats.last_commit_at = time.monotonic()

    async def _durable_point(self) -> list[TopicPartition]:
        """Make every completed epoch (in order, up to the first incomplete one) durable and return
        the offsets that may now be committed: the checkpoint flushes the sinks, delivers the dead
        letters, then saves the epochs' session deltas."""
        async with self._commit_lock:
            ready = self.epochs.take_completed_prefix()
            if not ready:
                return []
            deltas = [d for epoch in ready for d in epoch.deltas]
            deadlines = {}
            for delta in deltas:
                session = self._sessions.get(delta.shopper_id)
                if session is not None and session.pending is not None:
                    deadlines[delta.shopper_id] = self._wall_deadline(session)
            await self.checkpoint.make_durable(save_state=lambda: self.store.save(deltas, deadlines))
            self._evict()
            return [TopicPartition(t, p, o) for (t, p), o in merged_offsets(ready).items()]

    def _evict(self) -> None:
        """Bring the sessions held in memory down to ``session_cache_size``, the earliest loaded
        first, with their ``_partition_of`` entries. A busy session stays: one whose delta is in an
        epoch not yet durable, with unsaved changes, or with a pending trigger (its timer needs it).
        Busy sessions are skipped, not stopped at, so the cache stays above the bound only when every
        session left in it is busy."""
        excess = len(self._sessions) - self.settings.session_cache_size
        if excess <= 0:
            return
        busy = self.epochs.shoppers_in_flight()
        idle: list[str] = []
        for sid, session in self._sessions.items():
            if sid not in busy and not session.dirty and session.pending is None:
                idle.append(sid)
                if len(idle) == excess:
                    break
        for sid in idle:
            del self._sessions[sid]
            self._partition_of.pop(sid, None)

    async def _drain(self) -> None:
        """End of run: with ``until_drained`` fire every pending trigger first; then wait for all
        prompts, make everything durable and commit."""
        if self.settings.until_drained and self._failed is None:
            epoch = Epoch()
            fired = set()
            for sid, session in self._sessions.items():
                for prompt in self.processor.flush(session):
                    self._launch(prompt, epoch, None)
                    fired.add(sid)
            self._close_epoch(epoch, fired)
            self.timers.clear()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._failed is None:
            await self._commit_durable()

    # ---- rebalance (called on the consumer thread, inside consume) -------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """A new assignment starts unpaused. librdkafka keeps a partition's pause across a rebalance:
        one paused by backpressure when it was revoked came back paused while ``_paused`` said no, so
        nothing resumed it and the runner fetched nothing from it again (the broker-restart fault case
        hung that way now and then)."""
        self.log(f"rebalance: assigned partitions {sorted(tp.partition for tp in partitions)}")
        consumer.resume(partitions)
        self._assignment = list(partitions)
        self._generation += 1
        assert self._loop is not None
        self._loop.call_soon_threadsafe(
            self._start_rearm, self._generation, [tp.partition for tp in partitions]
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Hand the partitions over durable and committed, waiting at most ``revoke_timeout_s``: the
        consumer thread is blocked here, and a member that stalls its group's rebalance stalls the
        group. Past the bound the partitions go over uncommitted; the next owner replays them."""
        assert self._loop is not None
        self.log(f"rebalance: revoking partitions {sorted(tp.partition for tp in partitions)}")
        self._generation += 1  # a re-arm still running for these partitions arms nothing more
        self._loop.call_soon_threadsafe(self._cancel_rearms)
        if self._assignment and self._failed is None:
            future = asyncio.run_coroutine_threadsafe(self._handover(), self._loop)
            try:
                offsets = future.result(timeout=self.settings.revoke_timeout_s)
            except concurrent.futures.TimeoutError:
                future.cancel()
                self.log(
                    f"rebalance: results not durable within {self.settings.revoke_timeout_s} s; "
                    "partitions handed over uncommitted (the next owner replays them)"
                )
                offsets = []
            except Exception as exc:
                self.log(f"rebalance: hand-over failed ({exc!r}); partitions handed over uncommitted")
                offsets = []
            if offsets:
                try:
                    self._commit_offsets(offsets)
                except KafkaException as exc:  # fenced or broker away: the next owner replays them
                    self.log(f"rebalance: hand-over commit failed ({exc}); the next owner replays")
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._forget_assignment(), self._loop).result(timeout=5)
        self._assignment = []
        self._paused = False

    async def _handover(self) -> list[TopicPartition]:
        while not self.epochs.all_complete():
            await asyncio.sleep(0.05)
        return await self._durable_point()

    async def _forget_assignment(self) -> None:
        """After a hand-over (on the loop, like every other user of this state): the next owner holds
        these shoppers now. Epochs not yet durable are dropped, never committed for partitions this
        member no longer owns; their prompts still finish and write (idempotently)."""
        self.epochs.clear()
        self._sessions.clear()
        self._partition_of.clear()
        self.timers.clear()

    # ---- progress ------------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self.log(self._render_progress(final=False))

    def _render_progress(self, *, final: bool) -> str:
        return self._progress_line.render(
            in_flight=self._in_flight,
            lag=None if final else self.cached_lag(),
            undelivered_dead_letters=self.undelivered_dead_letters,
            final=final,
        )

    def cached_lag(self) -> int | None:
        """Lag from the watermarks the consumer last saw (no broker round trip)."""
        return sum(self.lag_by_partition().values()) if self._assignment else None

    def lag_by_partition(self) -> dict[int, int]:
        """Per assigned partition, from the watermarks the consumer last saw (no broker round trip)."""
        assignment = list(self._assignment)
        if not assignment:
            return {}
        lag = {}
        for tp in self.consumer.position(assignment):
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                lag[tp.partition] = max(0, high - max(tp.offset, 0))
        return lag
