"""The embedded runner: a thin engine shell on a Kafka consumer group (confluent-kafka).

Processing guarantees:
- per-partition order: one consumer per group member, and a shopper's events share a partition (key);
- at-least-once, made effectively-once by idempotent sinks: work is grouped in *epochs* (one poll, or
  one batch of fired timers). An epoch's session deltas are saved and its offsets committed only after
  every result it caused is durable (Redis written, S3 flushed, dead letters delivered), in epoch
  order. A crash replays from the last commit; replayed events are deduplicated by the restored
  sessions, and replayed prompts carry the same ``request_id``/``seq`` so sinks overwrite;
- backpressure: beyond ``max_in_flight_prompts`` the assigned partitions are paused (the consumer
  keeps polling, so it stays in the group) and resumed at half that;
- SIGTERM drains: no new polls, in-flight prompts finish, one last durable point and commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from llm_client.client import LLMClient
from pipeline.accounting import Accounting
from pipeline.enrichment import Enricher
from prompt_assembly.events import MalformedEvent, parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import EnrichmentResult, PromptRequest, ShopperInsight
from prompt_assembly.session import ShopperSession
from runner.config import RunnerSettings
from runner.session_store import RedisSessionStore, SessionDelta
from sinks.redis import RedisSignalSink
from sinks.s3 import S3InsightSink


@dataclass(slots=True)
class Epoch:
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    deltas: list[SessionDelta] = field(default_factory=list)
    pending: int = 0

    @property
    def complete(self) -> bool:
        return self.pending == 0


@dataclass(slots=True)
class RunnerStats:
    accounting: Accounting = field(default_factory=Accounting)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    estimated_shared_tokens: int = 0
    estimated_prompt_tokens: int = 0
    freshness_ms: list[float] = field(default_factory=list)
    commits: int = 0
    paused_times: int = 0
    first_event_at: float | None = None
    last_event_at: float | None = None
    """Monotonic times of the first and last event processed: the ingest window."""

    @property
    def ingest_rate(self) -> float:
        """Events per second between the first and the last event processed."""
        if self.first_event_at is None or self.last_event_at is None:
            return 0.0
        return self.accounting.consumed / max(1e-9, self.last_event_at - self.first_event_at)

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def dead_letter_value(message: Message, reason: str) -> bytes:
    value = message.value() or b""
    try:
        original: Any = value.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        import base64

        original, encoding = base64.b64encode(value).decode(), "base64"
    return orjson.dumps(
        {
            "reason": reason,
            "original": original,
            "encoding": encoding,
            "topic": message.topic(),
            "partition": message.partition(),
            "offset": message.offset(),
            "dead_lettered_at": time.time(),
        }
    )


class EmbeddedRunner:
    def __init__(self, settings: RunnerSettings, *, log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.processor = SessionProcessor(settings.session)
        self.stats = RunnerStats()
        self._sessions: dict[str, ShopperSession] = {}
        self._partition_of: dict[str, int] = {}
        self._epochs: deque[Epoch] = deque()
        self._timers: list[tuple[float, int, str, float]] = []
        self._timer_seq = 0
        self._timer_wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._paused = False
        self._stopping = asyncio.Event()
        self._failed: BaseException | None = None
        self._kafka_ts: dict[str, float] = {}
        self._assignment: list[TopicPartition] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_message_at = time.monotonic()
        self._commit_lock = asyncio.Lock()
        self._last_consumed, self._last_progress = 0, time.monotonic()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> RunnerStats:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        redis = aioredis.Redis.from_url(s.sinks.redis_url)
        self.store = RedisSessionStore(redis, s.sinks.redis_key_prefix)
        self.redis_sink = RedisSignalSink(s.sinks, redis)
        self.s3_sink = S3InsightSink(s.sinks)
        await self.s3_sink.ensure_bucket()
        self.consumer = Consumer(
            {
                "bootstrap.servers": s.bootstrap_servers,
                "group.id": s.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": s.kafka_session_timeout_ms,
                "heartbeat.interval.ms": max(250, s.kafka_session_timeout_ms // 6),
                "max.poll.interval.ms": max(60_000, s.kafka_session_timeout_ms),
                "enable.partition.eof": False,
                "log.connection.close": False,
            }
        )
        self.producer = Producer(
            {"bootstrap.servers": s.bootstrap_servers, "linger.ms": 20, "log.connection.close": False}
        )
        self.consumer.subscribe([s.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self.request_stop)
        async with LLMClient(s.llm) as client:
            self.enricher = Enricher(client, s.enrichment)
            self.client = client
            workers = [
                asyncio.create_task(self._committer(), name="committer"),
                asyncio.create_task(self._timer_loop(), name="timers"),
                asyncio.create_task(self._progress(), name="progress"),
            ]
            try:
                await self._ingest()
                await self._drain()
            finally:
                for worker in workers:
                    worker.cancel()
                for worker in workers:
                    with contextlib.suppress(asyncio.CancelledError):
                        await worker
                await asyncio.to_thread(self.consumer.close)
                await asyncio.to_thread(self.producer.flush, 10)
                del self.producer  # librdkafka handles are released when the last reference goes
                await self.s3_sink.close()
                await redis.aclose()
        if self._failed is not None:
            raise self._failed
        self._report_progress(final=True)
        return self.stats

    def request_stop(self) -> None:
        self._stopping.set()

    # ---- ingest --------------------------------------------------------------------------------
    async def _ingest(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            self._apply_backpressure()
            messages = await asyncio.to_thread(self.consumer.consume, s.batch_max_events, s.poll_timeout_s)
            if self._failed is not None:
                return
            if messages:
                if self.stats.first_event_at is None:
                    self.stats.first_event_at = time.monotonic()
                await self._process(messages)
                self._last_message_at = self.stats.last_event_at = time.monotonic()
            elif s.until_drained and await self._caught_up():
                return

    async def _process(self, messages: list[Message]) -> None:
        acct = self.stats.accounting
        epoch = Epoch()
        parsed = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    self.log(f"kafka error: {error}")
                continue
            acct.consumed += 1
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            assert topic is not None and partition is not None and offset is not None  # a real record
            epoch.offsets[(topic, partition)] = offset + 1
            try:
                parsed.append((message, parse_event(message.value())))  # value: validated JSON bytes
            except MalformedEvent as exc:
                acct.dead_lettered += 1
                self.producer.produce(
                    self.settings.dlq_topic, key=message.key(), value=dead_letter_value(message, exc.reason)
                )
        self.producer.poll(0)
        missing = list({ev.shopper_id for _, ev in parsed if ev.shopper_id not in self._sessions})
        if missing:
            self._sessions.update(await self.store.load_many(missing))
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
        """Snapshot the touched sessions' changes into ``epoch`` and queue it (in order)."""
        for sid in touched:
            session = self._sessions[sid]
            epoch.deltas.append(SessionDelta(sid, self._partition_of.get(sid, 0), session.take_changes()))
            if session.pending is not None:
                self._arm(sid, session)
        self._epochs.append(epoch)

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
            result = await self.enricher.enrich(prompt)
            await self._store_result(result)
        except Exception as exc:  # a sink is down: stop without committing; a restart replays
            self._fail(exc)
            return
        finally:
            self._in_flight -= 1
        epoch.pending -= 1

    async def _store_result(self, result: EnrichmentResult) -> None:
        for attempt in range(5):
            try:
                await self.redis_sink.write([result])
                break
            except Exception:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)
        await self.s3_sink.write([result])
        acct = self.stats.accounting
        if isinstance(result, ShopperInsight):
            acct.insights += 1
            self.stats.prompt_tokens += result.usage.prompt_tokens
            self.stats.cached_tokens += result.usage.cached_tokens
        else:
            acct.errors += 1
            self.log(f"error record {result.request_id}: {result.error_type}: {result.message[:160]}")
        produced = self._kafka_ts.pop(result.request_id, None)
        if produced is not None:
            self.stats.freshness_ms.append((time.time() - produced) * 1000)

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
        return await asyncio.to_thread(self._lag) == 0

    def _lag(self) -> int:
        """Events not yet processed in *any* partition of the topic: this member's partitions by its
        position, the others' by the group's committed offset. A member that died keeps its partitions
        until its session times out; only the whole topic being done means drained."""
        topic = self.settings.topic
        metadata = self.consumer.list_topics(topic, timeout=5).topics[topic]
        everything = [TopicPartition(topic, p) for p in metadata.partitions]
        done = {tp.partition: tp.offset for tp in self.consumer.committed(everything, timeout=5)}
        done.update({tp.partition: tp.offset for tp in self.consumer.position(self._assignment)})
        lag = 0
        for tp in everything:
            _, high = self.consumer.get_watermark_offsets(tp, timeout=5, cached=False)
            lag += max(0, high - max(done.get(tp.partition, 0), 0))
        return lag

    # ---- timers --------------------------------------------------------------------------------
    def _wall_deadline(self, session: ShopperSession) -> float:
        assert session.pending is not None
        wait = max(0.0, session.pending.due_ts - session.last_event_ts)
        return time.time() + wait * self.settings.timer_wall_per_event_s

    def _arm(self, sid: str, session: ShopperSession, wall: float | None = None) -> None:
        assert session.pending is not None
        self._timer_seq += 1
        deadline = self._wall_deadline(session) if wall is None else wall
        heapq.heappush(self._timers, (deadline, self._timer_seq, sid, session.pending.due_ts))
        self._timer_wakeup.set()

    async def _timer_loop(self) -> None:
        while True:
            now = time.time()
            fired: set[str] = set()
            epoch = Epoch()
            while self._timers and self._timers[0][0] <= now:
                _, _, sid, due_ts = heapq.heappop(self._timers)
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
            self._timer_wakeup.clear()
            sleep = min(1.0, self._timers[0][0] - time.time()) if self._timers else 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timer_wakeup.wait(), max(0.01, sleep))

    async def _rearm(self, partitions: list[int]) -> None:
        for partition in partitions:
            timers = await self.store.timers(partition)
            sids = [sid for sid, _ in timers if sid not in self._sessions]
            self._sessions.update(await self.store.load_many(sids))
            for sid, wall in timers:
                session = self._sessions.get(sid)
                if session is not None and session.pending is not None:
                    self._partition_of[sid] = partition
                    self._arm(sid, session, wall)

    # ---- durability ----------------------------------------------------------------------------
    async def _committer(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            try:
                offsets = await self._durable_point()
                if offsets:
                    await asyncio.to_thread(self.consumer.commit, offsets=offsets, asynchronous=False)
                    self.stats.commits += 1
            except Exception as exc:
                self._fail(exc)
                return

    async def _durable_point(self) -> list[TopicPartition]:
        """Make every completed epoch (in order, up to the first incomplete one) durable and return
        the offsets that may now be committed."""
        async with self._commit_lock:
            ready: list[Epoch] = []
            while self._epochs and self._epochs[0].complete:
                ready.append(self._epochs.popleft())
            if not ready:
                return []
            await self.s3_sink.flush()
            remaining = await asyncio.to_thread(self.producer.flush, 30)
            if remaining:
                raise RuntimeError(f"{remaining} dead letters not delivered")
            deltas = [d for epoch in ready for d in epoch.deltas]
            deadlines = {}
            for delta in deltas:
                session = self._sessions.get(delta.shopper_id)
                if session is not None and session.pending is not None:
                    deadlines[delta.shopper_id] = self._wall_deadline(session)
            await self.store.save(deltas, deadlines)
            merged: dict[tuple[str, int], int] = {}
            for epoch in ready:
                for tp, offset in epoch.offsets.items():
                    merged[tp] = max(merged.get(tp, 0), offset)
            self._evict()
            return [TopicPartition(t, p, o) for (t, p), o in merged.items()]

    def _evict(self) -> None:
        excess = len(self._sessions) - self.settings.session_cache_size
        if excess <= 0:
            return
        busy = {d.shopper_id for epoch in self._epochs for d in epoch.deltas}
        for sid in list(self._sessions)[:excess]:
            session = self._sessions[sid]
            if sid not in busy and not session.dirty and session.pending is None:
                del self._sessions[sid]

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
            self._timers.clear()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._failed is None:
            offsets = await self._durable_point()
            if offsets:
                await asyncio.to_thread(self.consumer.commit, offsets=offsets, asynchronous=False)
                self.stats.commits += 1

    # ---- rebalance (called on the consumer thread, inside consume) -------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assignment = list(partitions)
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._rearm([tp.partition for tp in partitions]), self._loop)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        assert self._loop is not None
        if self._assignment and self._failed is None:
            future = asyncio.run_coroutine_threadsafe(self._handover(), self._loop)
            offsets = future.result()
            if offsets:
                consumer.commit(offsets=offsets, asynchronous=False)
        self._assignment = []
        self._paused = False

    async def _handover(self) -> list[TopicPartition]:
        while any(not e.complete for e in self._epochs):
            await asyncio.sleep(0.05)
        offsets = await self._durable_point()
        self._sessions.clear()
        self._timers.clear()
        return offsets

    # ---- progress ------------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self._report_progress()

    def _cached_lag(self) -> int | None:
        """Lag from the watermarks the consumer last saw (no broker round trip)."""
        if not self._assignment:
            return None
        lag = 0
        for tp in self.consumer.position(self._assignment):
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                lag += max(0, high - max(tp.offset, 0))
        return lag

    def _report_progress(self, final: bool = False) -> None:
        now = time.monotonic()
        acct = self.stats.accounting
        rate = (acct.consumed - self._last_consumed) / max(1e-9, now - self._last_progress)
        self._last_consumed, self._last_progress = acct.consumed, now
        lag = None if final else self._cached_lag()
        self.log(
            f"[{'done' if final else 'progress'}] events {acct.consumed} ({rate:,.0f}/s) "
            f"lag {'-' if lag is None else lag} dlq {acct.dead_lettered} dup {acct.duplicates} "
            f"prompts {acct.prompts} in-flight {self._in_flight} insights {acct.insights} "
            f"errors {acct.errors} cache-hit {self.stats.cache_hit_ratio:.0%} commits {self.stats.commits}"
        )
