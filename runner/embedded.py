"""The embedded runner: a thin engine shell on a Kafka consumer group (confluent-kafka).

It only delivers: records in, each shopper's events in order to the engine-free step
(``SessionProcessor``), prompts to the enrichment step, results to the sinks, progress made durable.
This module wires the parts and runs them; each concern is a module of its own, which owns its state:

- ``ingest``: the poll loop, consumer errors, backpressure, each poll turned into an epoch;
- ``sessions``: the sessions held in memory and their eviction; ``session_store``: sessions in Redis;
- ``prompt_flight``: prompts in flight, their results stored;
- ``trigger_loop`` and ``timers``: pending triggers fired on the wall clock;
- ``repartition``: events whose Kafka key is not their shopper id, produced keyed by it to the
  runner's repartition topic (subscribed with the event topic) and applied from there;
- ``commits`` and ``epochs``: the durable point and offset commits, and what may be committed;
- ``handover`` and ``assignment``: the rebalance hand-over, and what this member owns;
- ``progress``, ``metrics``/``health``/``ops_server``, ``logs``: counters, the progress line,
  Prometheus ``/metrics`` and ``/health``, text or JSON lines; ``dead_letters``: a DLQ that cannot
  stop the stream.
 The dead-letter record, the
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
- SIGTERM drains: no new records (the partitions paused, the consumer polling on so that it stays in
  the group), in-flight prompts finish, one last durable point and commit;
- a consumer error no retry can fix (a fatal error, a refused login or TLS handshake, a topic that
  stays unknown past ``unknown_topic_grace_s``) stops the runner with ``runner.errors.ConsumerFailed``;
  a broker that is away is waited for (``runner.consumer_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from confluent_kafka import Consumer, KafkaException, Producer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from llm_client.client import LLMClient
from pipeline.answer_ledger import AnswerLedger
from pipeline.cancellation import cancel_and_wait
from pipeline.checkpoint import Checkpoint
from pipeline.enrichment import Enricher
from pipeline.kafka_security import librdkafka_properties
from pipeline.sink_retry import with_sink_retry
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.session import ShopperSession
from runner.assignment import Assignment
from runner.commits import Committer
from runner.config import RunnerSettings
from runner.dead_letters import DeadLetterPublisher
from runner.epochs import Epoch, EpochLog
from runner.errors import SessionStoreUnavailable
from runner.gc_tuning import streaming_gc
from runner.handover import RebalanceHandover
from runner.ingest import Ingest
from runner.logs import line_logger
from runner.metrics import RunnerMetrics
from runner.ops_server import OpsServer
from runner.ownership import PartitionOwnership
from runner.progress import ProgressLine, RunnerStats, cached_lag_by_partition
from runner.prompt_flight import PromptFlight
from runner.repartition import Deliveries, Repartitioner, ensure_topic
from runner.session_store import RedisSessionStore, SessionDelta
from runner.sessions import SessionCache
from runner.start_cleanup import StartCleanup, purge_and_close
from runner.timers import TimerQueue
from runner.trigger_loop import TriggerLoop
from sinks.registry import SinkResources, build_sinks

T = TypeVar("T")

__all__ = ["EmbeddedRunner", "RunnerStats"]


@contextlib.contextmanager
def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT call ``stop`` (the runner drains) while the block runs; the process's own
    handlers are back after it. asyncio's ``remove_signal_handler``, which closing the loop calls, sets
    the defaults instead: a process that runs a runner inside it (a test session, an application)
    lost its own SIGTERM handling for good after the first run."""
    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, stop)
            previous[sig] = before
    try:
        yield
    finally:
        for sig, before in previous.items():
            loop.remove_signal_handler(sig)
            if before is not None:
                signal.signal(sig, before)


class EmbeddedRunner:
    store: RedisSessionStore
    consumer: Consumer
    checkpoint: Checkpoint
    dead_letters: DeadLetterPublisher
    rekeyer: Repartitioner
    enricher: Enricher

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        log: Callable[[str], None] | None = None,
        session_store: Callable[[aioredis.Redis, str], RedisSessionStore] = RedisSessionStore,
    ) -> None:
        """``session_store`` makes the session store on the runner's Redis client and key prefix (a
        test passes a subclass that holds a load, to make an interleaving certain rather than likely)."""
        self.settings = settings
        self._session_store = session_store
        self.log = (
            log if log is not None else line_logger(settings.log_format)
        )  # an empty list-like log is falsy
        self.processor = SessionProcessor(settings.session)
        self.event_window = settings.session.event_time
        self.stats = RunnerStats()
        self.epochs = EpochLog()
        self.timers = TimerQueue()
        self.sessions = SessionCache(settings.session_cache_size)
        self.assignment = Assignment()
        self.ownership = PartitionOwnership(self)
        self.ingest = Ingest(self)
        self.prompts = PromptFlight(self)
        self._lag: dict[int, int] = {}
        """Records behind per assigned partition, as ``_measure_lag`` last measured them."""
        self.triggers = TriggerLoop(self)
        self.commits = Committer(self)
        self.handover = RebalanceHandover(self)
        self._progress_line = ProgressLine(
            self.stats, consumed="events" if settings.input == "events" else "records"
        )
        self._stopping = asyncio.Event()
        self._failed: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()
        self.metrics = RunnerMetrics(self)
        self.ops: OpsServer | None = None
        """``/metrics`` and ``/health`` while running, when ``metrics_port`` is set."""

    # ---- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> RunnerStats:
        s = self.settings
        self.loop = asyncio.get_running_loop()
        kafka = {"bootstrap.servers": s.bootstrap_servers, **librdkafka_properties(s.kafka_security)}
        repartition_topic = s.repartition_topic_name
        await asyncio.to_thread(  # before anything is opened: a topic that cannot be made stops it here
            ensure_topic,
            {**kafka, "log.connection.close": False},
            s.topic,
            repartition_topic,
            group_id=s.group_id,
            grace_s=s.unknown_topic_grace_s,
            log=self.log,
        )
        redis = s.sinks.redis_client()  # ACL user, password and CA from SinkSettings
        # A start step that fails closes what the steps before it opened; once the stream runs, the
        # finally below closes it all instead, in the order a shutdown needs (runner.start_cleanup).
        async with StartCleanup(self.log) as start:
            start.on_failure("the Redis client", redis.aclose)
            self.store = self._session_store(redis, s.sinks.redis_key_prefix)
            start.on_failure("the runner's references to its producers and sinks", self._forget_closed)
            # Java's default partitioner (the Flink job's DLQ sink), not librdkafka's CRC32: a key's dead
            # letters share a partition whichever engine wrote them.
            producer = Producer(
                {**kafka, "linger.ms": 20, "partitioner": "murmur2_random", "log.connection.close": False}
            )
            start.on_failure(
                "the dead-letter producer",
                functools.partial(asyncio.to_thread, purge_and_close, producer),
            )
            self.dead_letters = DeadLetterPublisher(
                producer,
                s.dlq_topic,
                self.log,
                max_original_bytes=s.dlq_max_original_bytes,
                counts=self.stats.dead_letters,
                deliver_max_wait_s=s.sink_retry.max_wait_s,
            )
            rekey_producer = Producer(
                {
                    **kafka,
                    "linger.ms": 5,
                    "enable.idempotence": True,  # the copies keep their order across librdkafka's retries
                    "partitioner": s.rekey_partitioner,
                    "log.connection.close": False,
                }
            )
            start.on_failure(
                "the repartition producer",
                functools.partial(asyncio.to_thread, purge_and_close, rekey_producer),
            )
            self.rekeyer = Repartitioner(
                rekey_producer,
                repartition_topic,
                self.log,
                deliver_max_wait_s=s.sink_retry.max_wait_s,
                failure=lambda: self._failed,
            )
            self.checkpoint = Checkpoint(
                build_sinks(s.sinks, SinkResources(redis=redis, kafka=kafka)),
                s.sink_retry,
                dead_letters=Deliveries(self.dead_letters, self.rekeyer),
                on_retry=self._on_sink_retry,
            )
            start.on_failure("the sinks", self.checkpoint.close)  # also those a failed open left half open
            await self.checkpoint.open()  # a store still down past the retry policy stops the start here
            start.on_failure("the partitions' re-arms", self.handover.stop)  # any the consumer's close began
            # The range assignor gives partition p of both topics to one member (runner.repartition).
            self.consumer = Consumer(
                {**self.ingest.consumer_config(), "partition.assignment.strategy": "range"}
            )
            start.on_failure("the consumer", functools.partial(asyncio.to_thread, self.consumer.close))
            self.consumer.subscribe(
                [s.topic, repartition_topic],
                on_assign=self.handover.on_assign,
                on_revoke=self.handover.on_revoke,
            )
            with stop_on_signals(self.loop, self.request_stop):
                async with LLMClient(s.llm) as client:
                    # answers recorded as they arrive, so a replay after a kill does not pay again
                    self.enricher = Enricher(
                        client,
                        s.enrichment,
                        ledger=AnswerLedger.from_settings(s.sinks, redis),
                        scope=s.sinks.redis_key_prefix,
                    )
                    self.client = client
                    if s.metrics_port is not None:
                        self.ops = OpsServer(self, self.metrics, host=s.metrics_host, port=s.metrics_port)
                        start.on_failure("the ops server", self.ops.stop)
                        await self.ops.start()
                        self.log(f"metrics and health on {self.ops.address}")
                    start.started()
                    timers = asyncio.create_task(self.triggers.run(), name="timers")
                    timers.add_done_callback(self._timers_done)
                    workers = [
                        asyncio.create_task(self.commits.run(), name="committer"),
                        timers,
                        asyncio.create_task(self._progress(), name="progress"),
                        asyncio.create_task(self._measure_lag(), name="lag"),
                    ]
                    try:
                        with streaming_gc():  # the per-event objects live on: see runner.gc_tuning
                            await self.ingest.run()
                        await self._drain(timers)
                    finally:
                        for worker in workers:
                            worker.cancel()
                        # A worker's error fails the runner, raised once everything below is closed.
                        # Raised here, the trigger loop's skipped the shutdown: the consumer stayed in
                        # the group holding its partitions, the clients and the ops server stayed open.
                        for worker in workers:
                            # Cancelled again until it ends: redis-py can swallow a cancel that lands in
                            # a session save or a timer load (``pipeline.cancellation``), and the runner
                            # waited for that worker for good.
                            # A cancel of the runner itself meanwhile is not taken for the worker's: the
                            # worker still ends before the clients it uses are closed below.
                            while not worker.done():
                                with contextlib.suppress(asyncio.CancelledError):
                                    await cancel_and_wait(worker)
                            if not worker.cancelled() and isinstance(error := worker.exception(), Exception):
                                self.fail(error)  # a no-op for one that failed it already
                        await self.handover.stop()
                        await asyncio.to_thread(self.consumer.close)
                        await asyncio.to_thread(self.dead_letters.flush, 10)
                        await asyncio.to_thread(self.rekeyer.producer.flush, 10)
                        await self.checkpoint.close()
                        # Closed here, not left to the collector: a failed run's error holds this
                        # frame (``producer``, ``rekey_producer``) and the runner for as long as it is
                        # held, and a process that embeds the runner kept their threads dialling the
                        # broker until a full collection.
                        await asyncio.to_thread(purge_and_close, self.dead_letters.producer)
                        await asyncio.to_thread(purge_and_close, self.rekeyer.producer)
                        del self.dead_letters, self.rekeyer, self.checkpoint
                        await redis.aclose()
                        if self.ops is not None:
                            await self.ops.stop()
        if self._failed is not None:
            raise self._failed
        self.log(self._render_progress(final=True))
        return self.stats

    async def _drain(self, timers: asyncio.Task[None]) -> None:
        """End of run: with ``until_drained`` fire every pending trigger first; then wait for all
        prompts, make everything durable and commit.

        No timer fires once the drain begins: a prompt one launched during the last commit was neither
        waited for nor stored, so the restart paid for it again. A trigger still pending stays in the
        session store with its deadline, and the next owner of its partition fires it."""
        timers.cancel()  # it awaits only between whole passes: no pass is left half done
        await asyncio.wait([timers])
        if not timers.cancelled() and (error := timers.exception()) is not None:
            self.fail(error)  # it had died before: the runner fails, and commits nothing more
        if self.settings.until_drained and self._failed is None:
            self.triggers.fire_all()
        if self._failed is not None:  # the consumer may be what failed: no poll, nothing committed
            await self.prompts.wait_all()
            return
        # Polling on, the partitions paused, while the prompts finish: a drain that outlasts
        # max.poll.interval.ms (a slow fleet, a store that is down) left the group, and its last
        # commit then failed, so a restart replayed all it had just made durable.
        await self.ingest.polling_while(self.prompts.wait_all())
        if self._failed is None:
            await self.ingest.polling_while(self.commits.commit_durable())

    def _timers_done(self, timers: asyncio.Task[None]) -> None:
        """The trigger loop runs for the whole run: ended by an error, it fails the runner at once. Left
        alone it had died silently: browse pauses stopped for the rest of the run while health stayed
        live and ready, and the error surfaced only at the drain."""
        if not timers.cancelled() and (error := timers.exception()) is not None:
            self.log(f"the trigger loop failed: {error!r}")
            self.fail(error)

    def _forget_closed(self) -> None:
        """After a failed start, as after a shutdown: the closed producers and sinks are not kept."""
        for name in ("dead_letters", "rekeyer", "checkpoint"):
            vars(self).pop(name, None)

    def request_stop(self) -> None:
        self._stopping.set()

    def fail(self, exc: BaseException) -> None:
        """Stop the runner: nothing more is committed, and ``run`` raises ``exc``."""
        if self._failed is None:
            self._failed = exc
            self.log(f"runner failing, nothing more will be committed: {exc!r}")
        self._stopping.set()

    # ---- steps every concern shares --------------------------------------------------------------
    def close_epoch(self, epoch: Epoch, touched: set[str]) -> None:
        """Snapshot the touched sessions' changes into ``epoch``, arm their pending triggers, and log
        the epoch (in order)."""
        sessions = self.sessions
        for sid in touched:
            session = sessions[sid]
            sessions.touch(sid)
            deadline = None
            if session.pending is not None:
                deadline = self.triggers.wall_deadline(session)
                self.timers.arm(sid, session.pending.due_ts, deadline, (session.epoch, session.seq))
            changes = session.take_changes()
            epoch.deltas.append(SessionDelta(sid, sessions.partition_of(sid), changes, deadline))
        self.epochs.append(epoch)

    async def retrying(self, load: Callable[[], Awaitable[T]], what: str) -> T:
        """A session-store load, waited for under ``sink_retry``; past it, ``SessionStoreUnavailable``
        (one line that says what to check, not the Redis client's traceback)."""
        started = time.monotonic()
        try:
            return await with_sink_retry(
                load, self.settings.sink_retry, what=what, on_retry=self._on_sink_retry
            )
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:  # unreachable, not a bad key
            raise SessionStoreUnavailable(what, time.monotonic() - started, exc) from exc

    async def load_sessions(self, shopper_ids: Sequence[str]) -> dict[str, ShopperSession]:
        """The stored sessions of ``shopper_ids`` (``retrying``). One the store could not wholly read
        (``ShopperSession.salvage``) is counted, and said in one line per load: a rollback past a
        change of the stored state makes that every shopper."""
        loaded = await self.retrying(functools.partial(self.store.load_many, shopper_ids), "session load")
        damaged = self.store.take_damaged()
        if damaged:
            self.stats.sessions_salvaged += len(damaged)
            self.stats.session_entries_unreadable += sum(damage.entries_dropped for _, damage in damaged)
            shopper_id, first = damaged[0]
            started_over = sum(damage.header_lost for _, damage in damaged)
            self.log(
                f"session state unreadable for {len(damaged)} shopper(s), {started_over} started over, "
                f"the rest without the entries that could not be read (first: {shopper_id!r}, {first.why}); "
                "their next save rewrites it"
            )
        return loaded

    def _on_sink_retry(self, what: str, exc: BaseException) -> None:
        self.stats.sink_retries += 1
        if self.stats.sink_retries % 20 == 1:
            self.log(f"{what} failed, retrying: {exc!r}")

    # ---- what metrics and health read (runner.health.RunnerView) ----------------------------------
    @property
    def in_flight(self) -> int:
        return self.prompts.in_flight

    @property
    def undelivered_dead_letters(self) -> int:
        return self.stats.dead_letters.undelivered

    @property
    def paused(self) -> bool:
        return self.ingest.paused

    @property
    def llm_client(self) -> LLMClient | None:
        return getattr(self, "client", None)

    @property
    def enrichment(self) -> Enricher | None:
        return getattr(self, "enricher", None)

    @property
    def failure(self) -> BaseException | None:
        return self._failed

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def assigned_partitions(self) -> list[int]:
        """The event topic's partitions this member owns (``p`` of the repartition topic comes with
        them: ``runner.repartition``)."""
        topic = self.settings.topic
        return sorted(tp.partition for tp in self.assignment.partitions if tp.topic == topic)

    def session_resets(self) -> int:
        checkpoint: Checkpoint | None = getattr(self, "checkpoint", None)  # made in run(), dropped after
        return 0 if checkpoint is None else checkpoint.session_resets

    def results_too_large(self) -> int:
        checkpoint: Checkpoint | None = getattr(self, "checkpoint", None)
        return 0 if checkpoint is None else checkpoint.results_too_large

    def lag_by_partition(self) -> dict[int, int]:
        """Per assigned partition number, as ``_measure_lag`` last measured it: the event topic's and
        the repartition topic's partition of that number together. Never a consumer call: while a
        synchronous commit waits on an unreachable coordinator, librdkafka's Python consumer blocks
        every other call on it (``position``, ``assignment`` alike), and a call here would freeze the
        event loop, ``/metrics`` and every timer with it for as long as the broker is away."""
        owned = set(self.assigned_partitions())
        return {p: behind for p, behind in self._lag.items() if p in owned}

    async def _measure_lag(self) -> None:
        """About once a second (each progress interval, where shorter), the lag from the watermarks the
        consumer last saw (``cached_lag_by_partition``), measured on a thread: one measurement at a time, and
        a blocked or failed one only delays the next (the last one stands meanwhile). The committed
        offsets of partitions not read yet are asked once per assignment (``committed``), not every time."""
        generation, committed = -1, dict[str, dict[int, int]]()
        while True:
            if self.assignment.generation != generation:  # read before the partitions it goes with
                generation, committed = self.assignment.generation, {}
            assignment = list(self.assignment.partitions)
            lag: dict[int, int] = {}
            try:
                for topic in {tp.topic for tp in assignment}:
                    owned = [tp for tp in assignment if tp.topic == topic]
                    measured = await asyncio.to_thread(
                        cached_lag_by_partition, self.consumer, owned, committed.setdefault(topic, {})
                    )
                    for partition, behind in measured.items():
                        lag[partition] = lag.get(partition, 0) + behind
                self._lag = lag
            except KafkaException as exc:  # a partition revoked meanwhile: the next measurement has it
                self.log(f"lag not measured: {exc}")
            await asyncio.sleep(min(1.0, self.settings.progress_interval_s))

    def cached_lag(self) -> int | None:
        """Lag from the watermarks the consumer last saw (no broker round trip)."""
        return sum(self.lag_by_partition().values()) if self.assignment else None

    # ---- progress ------------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self.log(self._render_progress(final=False))

    def _render_progress(self, *, final: bool) -> str:
        enrichment = self.enrichment
        return self._progress_line.render(
            in_flight=self.prompts.in_flight,
            lag=None if final else self.cached_lag(),
            undelivered_dead_letters=self.undelivered_dead_letters,
            final=final,
            overload=None if enrichment is None else enrichment.counts,
            waiting=0 if enrichment is None else enrichment.gate.waiting,
            tokens=None if enrichment is None else enrichment.tokens,
            not_drained_because=self.ingest.not_drained_because,  # set by until_drained's check only
        )
