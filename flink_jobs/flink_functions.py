"""PyFlink shells around the engine-free parts. Each translates between Flink and one pure component:

- ``ParseShopperEvents``: bytes -> ``(shopper_id, event JSON)``; malformed input -> DLQ side output.
- ``ShopperSessionFunction``: keyed by shopper; ``SessionProcessor`` on a session kept in keyed state.
- ``EnrichPrompts``: async; ``Enricher`` (LLM client with KV-aware routing) -> one result each.
- ``WriteResults``: async; ``SinkCommitter`` -> the enabled sinks (``sinks.registry``), completing a
  call only once it is durable.

Records between operators are JSON strings (pydantic ``model_dump_json``): no pickling of project types,
and the same bytes the embedded runner and the Kafka topics carry. Functions receive the job settings as
a JSON string and build their clients in ``open`` (or lazily on the async operator's event loop).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, cast

import orjson
from pyflink.common import Row, Types
from pyflink.datastream import OutputTag
from pyflink.datastream.functions import AsyncFunction, KeyedProcessFunction, RuntimeContext
from pyflink.datastream.state import StateTtlConfig, ValueStateDescriptor
from pyflink.datastream.time_domain import TimeDomain

from flink_jobs.expiry_timers import ExpiryTimer, expiry_deadline_ms, next_expiry, unprompted_events
from flink_jobs.flink_config import NearRealtimeSettings
from flink_jobs.flink_connectors import DLQ_RECORD, UNKEYED_PREFIX
from flink_jobs.flink_metrics import OperatorStats
from flink_jobs.loop_resources import LoopResources
from flink_jobs.pause_timers import ArmedTimer, due_to_fire, rearm, restored_deadline_ms, wall_deadline_ms
from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES, dead_letter
from prompt_assembly.events import (
    DEFAULT_EVENT_TIME_WINDOW,
    EventTimeWindow,
    MalformedEvent,
    ShopperEvent,
    parse_event,
)
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import (
    EnrichmentError,
    EnrichmentResult,
    PromptRequest,
    ShopperInsight,
    Superseded,
)
from prompt_assembly.records import parse_result as parse_any_result
from prompt_assembly.session import RestoreDamage, ShopperSession

DLQ_TAG = OutputTag(
    "dlq", Types.ROW_NAMED(list(DLQ_RECORD), [Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.STRING()])
)
"""Dead letters with their original record's Kafka key (``dead_letter_record``), for the keyed DLQ sink."""
FLUSH_TIMER_TS = 2**63 - 1
"""Event-time timer that only the final watermark of a bounded input (or a drain) reaches."""

METRIC_GROUP = "shopper"
SALVAGE_LOG_INTERVAL_S = 10.0
"""At most one line this often about stored sessions read with damage (they are counted, all of them)."""
_log = logging.getLogger(__name__)


SourceRecord = tuple[bytes | None, str | None, int | None, int | None, int | None]
"""(value, topic, partition, offset, Kafka timestamp ms) of one source record."""


def source_record(value: Any, source_topic: str | None, base64_values: bool) -> SourceRecord:
    """One input element as (value bytes or None, topic, partition, offset, timestamp_ms). Input is a
    Kafka source row ``(value, topic, partition, offset, timestamp_ms, kafka_key)`` (the key:
    ``source_key``), or, in bounded test runs, a base64 string of the value."""
    if base64_values:
        return base64.b64decode(value), source_topic, None, None, None
    if isinstance(value, str | bytes):
        return (value.encode("utf-8") if isinstance(value, str) else value), source_topic, None, None, None
    raw, topic, partition, offset, timestamp_ms = (value[i] for i in range(5))
    return (None if raw is None else bytes(raw)), topic, partition, offset, timestamp_ms


def source_key(value: Any, base64_values: bool) -> bytes | None:
    """The Kafka key of one input element (the source row's ``kafka_key``), ``None`` where it has none:
    a record sent without a key, or a bounded run's value, which never had one."""
    if base64_values or isinstance(value, str | bytes) or len(value) < 6:
        return None
    key = value[5]
    return None if key is None else bytes(key)


def dead_letter_record(kafka_key: bytes | None, letter: str) -> Row:
    """What the DLQ side output carries (``DLQ_RECORD``): the dead letter, keyed on the DLQ topic by its
    original's Kafka key as the runner keys it (``runner.dead_letters``)."""
    return Row(kafka_key, letter)


def gate(
    record: SourceRecord,
    max_original_bytes: int = DEFAULT_MAX_ORIGINAL_BYTES,
    window: EventTimeWindow = DEFAULT_EVENT_TIME_WINDOW,
) -> ShopperEvent | str:
    """``parse_event`` on one record: the event, or its dead letter (``pipeline.dead_letter``, with the
    record's position and at most ``max_original_bytes`` of it, byte for byte the embedded runner's) as
    the JSON string the DLQ sink writes. Event time is checked against the record's Kafka timestamp
    (``window``), as the runner checks it."""
    timestamp_ms = record[4]
    try:
        return parse_event(record[0], None if timestamp_ms is None else timestamp_ms / 1000.0, window)
    except MalformedEvent as exc:
        return dead_letter_json(record, exc.reason, max_original_bytes)


def dead_letter_json(record: SourceRecord, reason: str, max_original_bytes: int) -> str:
    raw, topic, partition, offset, timestamp_ms = record
    letter = dead_letter(
        raw,
        reason,
        topic=topic,
        partition=partition,
        offset=offset,
        timestamp_ms=timestamp_ms,
        max_original_bytes=max_original_bytes,
    )
    return letter.to_bytes().decode("utf-8")


def shopper_key(value: str) -> str:
    """The partitioning key of a bounded run's base64 value: its ``shopper_id`` when it has one, else
    ``UNKEYED_PREFIX`` and a checksum of the value, so records without one spread over the subtasks (the
    gate rejects them). Kafka runs take it on the JVM side instead (``flink_connectors.SOURCE_QUERY``)."""
    try:
        data = orjson.loads(base64.b64decode(value))
    except (orjson.JSONDecodeError, ValueError):
        data = None
    key = data.get("shopper_id") if isinstance(data, dict) else None
    return key if isinstance(key, str) and key else f"{UNKEYED_PREFIX}{zlib.crc32(value.encode()):08x}"


class ShopperSessionFunction(KeyedProcessFunction):
    """The validation gate and one shopper's session in keyed ``ValueState`` (JSON, with TTL);
    deduplication is the session's. Records arrive keyed by the shopper id read on the JVM side (so no
    Python stage of its own does parsing or keying); a rejected record goes to the ``DLQ_TAG`` side
    output, and so does a valid event whose id differs from its key (only possible for JSON with a
    duplicated ``shopper_id`` field, which the JVM and pydantic read differently).

    Timers: one processing-time timer per shopper with a pending trigger, at a deadline relative to
    when its newest event was processed (``flink_jobs.pause_timers``: the runner's deadline, so a live
    browse pause fires once the quiet period has passed and a replayed backlog fires once per pause,
    not once per event; a timer restored from a checkpoint waits its quiet period again after the
    restart, so that the replay can move it), and one event-time timer at ``FLUSH_TIMER_TS`` while a
    trigger is pending: only the final watermark of a bounded input (or ``stop --drain``) reaches it,
    and it fires every pending trigger (``flush``). Where no processing-time timer fires the trigger,
    one more processing-time timer just before the session's TTL flushes it and drops the session with
    its timers (``flink_jobs.expiry_timers``), so the drain timer never outlives the session.
    """

    def __init__(
        self,
        settings_json: str,
        processing_time_timers: bool,
        flush_at_end: bool,
        source_topic: str | None = None,
        base64_values: bool = False,
    ) -> None:
        self.settings_json = settings_json
        self.processing_time_timers = processing_time_timers
        self.flush_at_end = flush_at_end
        self.source_topic = source_topic
        self.base64_values = base64_values

    def open(self, runtime_context: RuntimeContext) -> None:
        settings = NearRealtimeSettings.from_json(self.settings_json)
        self.processor = SessionProcessor(settings.session)
        self.dlq_max_original_bytes = settings.dlq_max_original_bytes
        self.lateness_ms = int(settings.max_lateness_for_timer_s * 1000)
        self.state = runtime_context.get_state(
            _with_ttl(ValueStateDescriptor("session", Types.STRING()), settings)
        )
        # The pending trigger's timer (``pause_timers.ArmedTimer``); the same TTL as the session.
        self.armed = runtime_context.get_state(
            _with_ttl(ValueStateDescriptor("pause_timer", Types.STRING()), settings)
        )
        # The expiry timer (``expiry_timers.ExpiryTimer``), where no pause timer fires the trigger. No
        # TTL: it goes with its timer, and counts what the session held if that expired first.
        self.expiry_timers = self.flush_at_end and not self.processing_time_timers
        self.ttl_ms = settings.state_ttl_s * 1000
        self.expiry = runtime_context.get_state(ValueStateDescriptor("expiry_timer", Types.STRING()))
        group = runtime_context.get_metrics_group().add_group(METRIC_GROUP)
        self.records_in = group.counter("events_in")
        self.records_valid = group.counter("events_valid")
        self.records_dlq = group.counter("events_dlq")
        self.duplicates = group.counter("events_duplicate")
        self.accepted = group.counter("events_accepted")
        self.prompts = group.counter("prompts_emitted")
        self.timer_prompts = group.counter("prompts_by_timer")
        self.flushed_prompts = group.counter("prompts_by_flush")
        self.restored_timers_deferred = group.counter("restored_timers_deferred")
        self.started_ms = int(time.time() * 1000)
        """When this run of the subtask opened, on the clock its timer service reads (the wall clock in
        milliseconds, in process and thread mode alike): timers armed before it were restored."""
        self.trimmed_unprompted = group.counter("events_trimmed_unprompted")
        self.expiry_prompts = group.counter("prompts_by_expiry")
        self.expired_unprompted = group.counter("events_expired_unprompted")
        self.timers_found_expired = group.counter("timers_found_expired_state")
        self.sessions_salvaged = group.counter("sessions_salvaged")
        self.entries_unreadable = group.counter("session_entries_unreadable")
        self.salvage_logged_at = 0.0

    def _load(self, shopper_id: str) -> ShopperSession:
        raw = self.state.value()
        return self.processor.new_session(shopper_id) if raw is None else self._restore(shopper_id, raw)

    def _restore(self, shopper_id: str, raw: str) -> ShopperSession:
        """The stored session, what this code cannot read of it left out (``ShopperSession.salvage``):
        raising here failed the job at the same record after every restart."""
        session, damage = ShopperSession.salvage_json(shopper_id, raw)
        if damage is not None:
            self._count_salvaged(shopper_id, damage)
        return session

    def _count_salvaged(self, shopper_id: str, damage: RestoreDamage) -> None:
        self.sessions_salvaged.inc()
        self.entries_unreadable.inc(damage.entries_dropped)
        now = time.monotonic()
        if now - self.salvage_logged_at >= SALVAGE_LOG_INTERVAL_S:  # a rollback makes it every shopper
            self.salvage_logged_at = now
            _log.warning(
                "session state unreadable for %r (%s): %s; its next save rewrites it",
                shopper_id,
                damage.why,
                "started over" if damage.header_lost else f"{damage.entries_dropped} entries left out",
            )

    def _save(self, session: ShopperSession, ctx: Any) -> None:
        session.take_changes()
        self.state.update(session.to_json().decode())
        timers = ctx.timer_service()
        if session.pending is None:
            if self.processing_time_timers:
                self._disarm(timers)
            if self.flush_at_end:
                timers.delete_event_time_timer(FLUSH_TIMER_TS)
            if self.expiry_timers:
                self._drop_expiry(timers)
            return
        if self.processing_time_timers:
            self._arm(session, timers)
        if self.flush_at_end:
            timers.register_event_time_timer(FLUSH_TIMER_TS)
        if self.expiry_timers:
            self._arm_expiry(session, timers)

    def _armed(self) -> ArmedTimer | None:
        raw = self.armed.value()
        return None if raw is None else ArmedTimer.from_state(raw)

    def _now_ms(self, timers: Any) -> int:
        """The processing time, never before this run opened: a timer armed in this run must not read
        as restored after the wall clock stepped back."""
        now_ms: int = timers.current_processing_time()
        return max(now_ms, self.started_ms)

    def _arm(self, session: ShopperSession, timers: Any) -> None:
        assert session.pending is not None
        now_ms = self._now_ms(timers)
        deadline = wall_deadline_ms(now_ms, session.pending.due_ts, session.last_event_ts, self.lateness_ms)
        change = rearm(self._armed(), session.pending.due_ts, deadline, now_ms)
        if change.delete_ms is not None:
            timers.delete_processing_time_timer(change.delete_ms)
        if change.register_ms is not None:
            timers.register_processing_time_timer(change.register_ms)
            self.armed.update(change.armed.to_state())

    def _disarm(self, timers: Any) -> None:
        armed = self._armed()
        if armed is not None:
            timers.delete_processing_time_timer(armed.fires_at_ms)
            self.armed.clear()

    def _expiry_timer(self) -> ExpiryTimer | None:
        raw = self.expiry.value()
        return None if raw is None else ExpiryTimer.from_state(raw)

    def _arm_expiry(self, session: ShopperSession, timers: Any) -> None:
        """Each save moves the expiry deadline, as it moves the session's TTL; the timer (one per
        shopper) moves when it goes off before it (``expiry_timers.next_expiry``)."""
        before = self._expiry_timer()
        deadline_ms = expiry_deadline_ms(self._now_ms(timers), self.ttl_ms)
        expiry = next_expiry(before, deadline_ms, unprompted_events(session))
        if before is None or before.fires_at_ms != expiry.fires_at_ms:
            if before is not None:
                timers.delete_processing_time_timer(before.fires_at_ms)
            timers.register_processing_time_timer(expiry.fires_at_ms)
        self.expiry.update(expiry.to_state())

    def _drop_expiry(self, timers: Any) -> None:
        expiry = self._expiry_timer()
        if expiry is not None:
            timers.delete_processing_time_timer(expiry.fires_at_ms)
            self.expiry.clear()

    def process_element(self, value: Any, ctx: KeyedProcessFunction.Context) -> Iterable[Any]:
        self.records_in.inc()
        record = source_record(value, self.source_topic, self.base64_values)
        event = gate(record, self.dlq_max_original_bytes, self.processor.config.event_time)
        key = _shopper_key(ctx)
        if isinstance(event, ShopperEvent) and event.shopper_id != key:
            # It cannot be re-keyed here: a dead letter, never a silently misplaced event. The gate
            # refuses what JSON_VALUE cannot read (a number past 1,000 characters, NaN), so this is
            # JSON the two parsers read differently.
            reason = (
                f"shopper_id {event.shopper_id[:60]!r} is not the key Flink's JSON_VALUE read "
                f"from the same record ({str(key)[:60]!r})"
            )
            event = dead_letter_json(record, reason, self.dlq_max_original_bytes)
        if isinstance(event, str):
            self.records_dlq.inc()
            yield DLQ_TAG, dead_letter_record(source_key(value, self.base64_values), event)
            return
        self.records_valid.inc()
        shopper_id = event.shopper_id
        session = self._load(shopper_id)
        applied = self.processor.apply(session, event, record[0])  # the raw JSON, kept as the runner keeps it
        if applied.outcome == "duplicate":
            self.duplicates.inc()
            return
        self.accepted.inc()
        self._save(session, ctx)
        self._count_emitted(applied.prompts)
        for prompt in applied.prompts:
            yield prompt.model_dump_json()

    def _count_emitted(self, prompts: list[PromptRequest]) -> None:
        self.prompts.inc(len(prompts))
        trimmed = sum(prompt.trimmed_events for prompt in prompts)
        if trimmed:
            self.trimmed_unprompted.inc(trimmed)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterable[str]:
        if ctx.time_domain() == TimeDomain.PROCESSING_TIME:
            expiry = self._expiry_timer()
            if expiry is not None and expiry.fires_at_ms == timestamp:
                yield from self._at_expiry(expiry, timestamp, ctx.timer_service(), _shopper_key(ctx))
                return
        raw = self.state.value()
        if raw is None:
            self._found_expired(ctx.timer_service())
            return
        session = self._restore(_shopper_key(ctx), raw)
        if ctx.time_domain() == TimeDomain.EVENT_TIME:
            prompts = self.processor.flush(session)
            self.flushed_prompts.inc(len(prompts))
        else:
            armed = self._armed()
            due_ts = due_to_fire(armed, timestamp, self.lateness_ms)
            if (
                armed is not None
                and due_ts is not None
                and self._deferred(session, armed, ctx.timer_service())
            ):
                return
            prompts = [] if due_ts is None else self.processor.fire_pending(session, due_ts)
            self.timer_prompts.inc(len(prompts))
        if not prompts:
            return
        self._save(session, ctx)
        self._count_emitted(prompts)
        for prompt in prompts:
            yield prompt.model_dump_json()

    def _at_expiry(self, expiry: ExpiryTimer, timestamp: int, timers: Any, shopper_id: str) -> Iterable[str]:
        """The session's TTL is about to run out with a trigger pending: the drain's flush for this
        shopper, then the session goes with its timers (``flink_jobs.expiry_timers``)."""
        if self.expiry_timers and expiry.deadline_ms > timestamp:  # saved since: its TTL moved on
            timers.register_processing_time_timer(expiry.deadline_ms)
            self.expiry.update(replace(expiry, fires_at_ms=expiry.deadline_ms).to_state())
            return
        raw = self.state.value()
        if raw is None:  # it expired first: the job was down across the deadline
            self._found_expired(timers)
            return
        self.expiry.clear()
        if not self.expiry_timers:  # armed by a run with another timer mode: saves no longer move it
            return
        prompts = self.processor.flush(self._restore(shopper_id, raw))
        self.expiry_prompts.inc(len(prompts))
        self._count_emitted(prompts)
        self.state.clear()
        self._disarm(timers)
        timers.delete_event_time_timer(FLUSH_TIMER_TS)
        for prompt in prompts:
            yield prompt.model_dump_json()

    def _found_expired(self, timers: Any) -> None:
        """A timer outlived its session's state. What that held unprompted is counted where the expiry
        timer's state knows it (a timer restored from a version before it does not), and the shopper's
        other timers go: no timer is left to a key without state."""
        self.timers_found_expired.inc()
        expiry = self._expiry_timer()
        if expiry is not None:
            self.expired_unprompted.inc(expiry.unprompted)
            timers.delete_processing_time_timer(expiry.fires_at_ms)
            self.expiry.clear()
        timers.delete_event_time_timer(FLUSH_TIMER_TS)

    def _deferred(self, session: ShopperSession, armed: ArmedTimer, timers: Any) -> bool:
        """Re-arm a timer restored from a checkpoint that went off before its quiet period after the
        restart was over (``pause_timers.restored_deadline_ms``); True when it was. A timer whose
        trigger is gone fires (nothing)."""
        now_ms = self._now_ms(timers)
        if session.pending is None:
            return False
        wait_ms = wall_deadline_ms(0, armed.due_ts, session.last_event_ts, self.lateness_ms)
        later = restored_deadline_ms(armed, now_ms, self.started_ms, wait_ms)
        if later is None:
            return False
        timers.register_processing_time_timer(later)
        self.armed.update(ArmedTimer(later, armed.due_ts, now_ms).to_state())
        self.restored_timers_deferred.inc()
        return True


class EnrichPrompts(AsyncFunction):
    """``PromptRequest`` JSON in, exactly one ``EnrichmentResult`` JSON out (an error is a result too).

    The client is created lazily on the operator's event loop (``open`` runs before that loop exists).
    Routing is the client's (``ClientConfig.policy``): a shopper's prompts go to the replica that holds
    their prefix in its KV cache. The client validates each answer (``Enricher``), tries an invalid one
    once more elsewhere and quarantines a replica that keeps sending them (reason in the TaskManager
    log; ``llm_replicas_quarantined`` and ``llm_invalid_answers`` gauges).
    """

    def __init__(self, settings_json: str) -> None:
        self.settings_json = settings_json

    def open(self, runtime_context: RuntimeContext) -> None:
        self.settings = NearRealtimeSettings.from_json(self.settings_json)
        self.enricher: Any = None
        self.resources = LoopResources(self.settings.async_io.close_timeout_ms / 1000)
        self._starting: asyncio.Lock | None = None
        self.stats = OperatorStats()
        group = runtime_context.get_metrics_group().add_group(METRIC_GROUP)
        self.stats.register(
            group,
            counters=[
                "llm_requests",
                "llm_insights",
                "llm_errors",
                "llm_superseded",
                "llm_timeouts",
                "llm_prompt_tokens",
                "llm_cached_tokens",
            ],
            windows=["llm_latency", "llm_ttft"],
            extra={
                "llm_in_flight": lambda: self.enricher.client.in_flight if self.enricher else 0,
                "llm_client_retries": lambda: self.enricher.client.retries if self.enricher else 0,
                "llm_replicas_quarantined": lambda: (
                    sum(e.quarantined for e in self.enricher.client.endpoints) if self.enricher else 0
                ),
                "llm_invalid_answers": lambda: (
                    sum(sum(e.invalid_answers.values()) for e in self.enricher.client.endpoints)
                    if self.enricher
                    else 0
                ),
                "llm_cache_hit_permille": lambda: self.stats.permille(
                    "llm_cached_tokens", "llm_prompt_tokens"
                ),
                # tokens of prompts sent, by whether their answer landed (pipeline.overload.TokenCounts)
                **{
                    f"llm_tokens_{name}": _token_gauge(self, name)
                    for name in ("landed_prefill", "landed_decode", "not_landed_prefill", "not_landed_decode")
                },
                "llm_tokens_not_landed_permille": lambda: (
                    round(1000 * self.enricher.tokens.not_landed_share) if self.enricher else 0
                ),
            },
        )

    async def _ensure_enricher(self) -> Any:
        if self.enricher is None:
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self.enricher is None:
                    from llm_client.client import LLMClient
                    from pipeline.answer_ledger import AnswerLedger
                    from pipeline.enrichment import Enricher

                    client = LLMClient(self.settings.llm)
                    self.resources.add(client.close)
                    await client.start()
                    ledger = None  # answers recorded as they arrive: a replay does not pay again
                    if "redis" in self.settings.sinks.enabled:  # it lives where the signals do
                        ledger = AnswerLedger.from_settings(self.settings.sinks)
                        self.resources.add(ledger.redis.aclose)
                    self.enricher = Enricher(
                        client,
                        self.settings.enrichment,
                        ledger=ledger,
                        scope=self.settings.sinks.redis_key_prefix,
                    )
        return self.enricher

    async def async_invoke(self, value: str) -> list[str]:
        enricher = await self._ensure_enricher()
        prompt = PromptRequest.model_validate_json(value)
        self.stats.inc("llm_requests")
        try:
            async with asyncio.timeout(self.settings.async_io.timeout_ms / 1000):
                result = await enricher.enrich(prompt)
        except TimeoutError:
            # An answer that came back as the timeout fired is recorded (``Enricher._answer``): it is
            # this prompt's result, not a timeout.
            kept = await enricher.recorded_answer(prompt)
            if kept is None:
                return self.timeout(value)
            result = kept
        self._record(result)
        return [result.model_dump_json()]

    def _record(self, result: EnrichmentResult) -> None:
        if isinstance(result, ShopperInsight):
            self.stats.inc("llm_insights")
            if not result.replayed:  # a ledger's or a joined call's answer: counted with its call
                self.stats.inc("llm_prompt_tokens", result.usage.prompt_tokens)
                self.stats.inc("llm_cached_tokens", result.usage.cached_tokens)
                self.stats.observe("llm_latency", result.latency_ms)
                self.stats.observe("llm_ttft", result.ttft_ms)
        elif isinstance(result, Superseded):  # not answered on purpose (pipeline.overload): no error
            self.stats.inc("llm_superseded")
        else:
            self.stats.inc("llm_errors")

    def timeout(self, value: str) -> list[str]:
        """Past the timeout the prompt still gets its one result: an error record. Called from
        ``async_invoke`` (the loop-side timeout), or by Flink when Flink-level retries are on."""
        self.stats.inc("llm_timeouts")
        prompt = PromptRequest.model_validate_json(value)
        error = EnrichmentError(
            request_id=prompt.request_id,
            shopper_id=prompt.shopper_id,
            session_epoch=prompt.session_epoch,
            seq=prompt.seq,
            reason=prompt.reason,
            error_type="FlinkAsyncTimeout",
            message=f"no result within the async operator's {self.settings.async_io.timeout_ms} ms",
            attempts=0,
            new_event_ids=prompt.new_event_ids,
            trimmed_event_ids=prompt.trimmed_event_ids,
            trimmed_events=prompt.trimmed_events,
            last_event_ts=prompt.last_event_ts,
            due_ts=prompt.due_ts,
            produced_at=time.time(),
        )
        return [error.model_dump_json()]

    def close(self) -> None:
        """The LLM client (its connections and health task) is closed on the operator's event loop as
        that loop closes (``LoopResources``); this waits for it."""
        self.resources.close()
        self.enricher = None


RETRYABLE_RESULT_ERRORS = frozenset({"NoHealthyEndpoint"})
"""Error results worth a Flink-level retry after a backoff: every replica was ejected. Other errors were
already retried by the client under its retry budget; retrying them again would multiply an outage."""


def is_retryable_result(results: list[str]) -> bool:
    for raw in results:
        data = orjson.loads(raw)
        if data.get("kind") == "error" and data.get("error_type") in RETRYABLE_RESULT_ERRORS:
            return True
    return False


WRITTEN_COUNTERS = {
    "insight": "insights_written",
    "error": "errors_written",
    "superseded": "superseded_written",
}
"""The sink step's counter of each result kind."""


class WriteResults(AsyncFunction):
    """Results to the enabled sinks through the shared ``Checkpoint``; a call completes once its result
    is durable in every one, so the drain before each checkpoint makes the sinks at-least-once (see
    ``SinkCommitter``)."""

    def __init__(self, settings_json: str) -> None:
        self.settings_json = settings_json

    def open(self, runtime_context: RuntimeContext) -> None:
        self.settings = NearRealtimeSettings.from_json(self.settings_json)
        self.committer: Any = None
        self.resources = LoopResources(self.settings.async_io.close_timeout_ms / 1000)
        self.retries = 0
        self.stats = OperatorStats()
        group = runtime_context.get_metrics_group().add_group(METRIC_GROUP)
        self.stats.register(
            group,
            counters=["results_written", "insights_written", "errors_written", "superseded_written"],
            windows=["freshness", "sink_commit"],
            extra={
                "sink_flushes": lambda: self.committer.flushes if self.committer else 0,
                "sink_batches": lambda: self.committer.batches if self.committer else 0,
                # The runner's name: a job waiting out a store outage is told from an idle one.
                "sink_retries": lambda: self.retries,
                # A shopper's session state was lost while their signal lived (a new session epoch).
                "session_resets": lambda: self.committer.checkpoint.session_resets if self.committer else 0,
                # Results over a Kafka size limit: missing from the results topic (Redis and S3 hold them).
                "results_too_large": lambda: (
                    self.committer.checkpoint.results_too_large if self.committer else 0
                ),
            },
        )

    def _ensure_committer(self) -> Any:
        """On the operator's event loop (``async_invoke``): the committer, its task and its sinks' clients
        live there, and are closed there (``LoopResources``)."""
        if self.committer is None:
            from pipeline.checkpoint import Checkpoint
            from pipeline.sink_commit import SinkCommitter
            from sinks.registry import SinkResources, build_sinks

            sinks = build_sinks(self.settings.sinks, SinkResources(), names=self.settings.result_sinks)
            checkpoint = Checkpoint(sinks, self.settings.sink_retry, on_retry=self._retried)
            self.committer = SinkCommitter(
                checkpoint,
                idle_flush_s=self.settings.async_io.sink_idle_flush_ms / 1000,
                on_written=self._on_written,
            )
            self.resources.add(self.committer.close)
        return self.committer

    def _retried(self, what: str, exc: BaseException) -> None:
        self.retries += 1

    def _on_written(self, results: Any) -> None:
        now = time.time()
        for result in results:
            # End-to-end freshness: from the newest event in the prompt to its answer being readable.
            self.stats.observe("freshness", (now - result.last_event_ts) * 1000)

    async def async_invoke(self, value: str) -> list[str]:
        committer = self._ensure_committer()
        result = parse_result(value)
        started = time.perf_counter()
        async with asyncio.timeout(self.settings.async_io.sink_timeout_ms / 1000):
            await committer.submit(result)
        self.stats.observe("sink_commit", (time.perf_counter() - started) * 1000)
        if result.kind != "superseded":  # results_written is insights + errors on both engines
            self.stats.inc("results_written")
        self.stats.inc(WRITTEN_COUNTERS[result.kind])
        return [value]

    def close(self) -> None:
        """The committer's task, the Redis pool and the S3 client are closed on the operator's event loop
        as that loop closes (``LoopResources``); this waits for it. Results written but not yet durable
        were never acknowledged: the job replays them from its last checkpoint."""
        self.resources.close()
        self.committer = None


class EnrichAndWrite(AsyncFunction):
    """``EnrichPrompts`` then ``WriteResults`` in one async call: one Python stage (one bundle of input
    buffering and one drain) instead of two. The call completes once its result is durable, so the
    sinks keep their at-least-once guarantee. Used when Flink-level retries are off (a retry would
    re-run the write of an error result)."""

    def __init__(self, settings_json: str) -> None:
        self.enrich = EnrichPrompts(settings_json)
        self.write = WriteResults(settings_json)

    def open(self, runtime_context: RuntimeContext) -> None:
        self.enrich.open(runtime_context)
        self.write.open(runtime_context)

    async def async_invoke(self, value: str) -> list[str]:
        results = await self.enrich.async_invoke(value)
        for result in results:
            await self.write.async_invoke(result)
        return results

    def close(self) -> None:
        self.enrich.close()
        self.write.close()


def parse_result(raw: str) -> EnrichmentResult:
    """A result from its JSON, whichever kind (``prompt_assembly.records.parse_result``): an insight,
    an error or a superseded prompt, never one kind read as another."""
    return parse_any_result(raw)


def _shopper_key(ctx: Any) -> str:
    """The current key: the shopper id, which the JVM side hands over as a one-field Row."""
    key = ctx.get_current_key()
    return cast("str", key[0] if isinstance(key, tuple | list) or hasattr(key, "_values") else key)


def _with_ttl(descriptor: ValueStateDescriptor, settings: NearRealtimeSettings) -> ValueStateDescriptor:
    """``descriptor`` expiring ``state_ttl_s`` after its last write (a quiet shopper is dropped)."""
    descriptor.enable_time_to_live(
        StateTtlConfig.new_builder(_seconds(settings.state_ttl_s))
        .set_update_type(StateTtlConfig.UpdateType.OnCreateAndWrite)
        .set_state_visibility(StateTtlConfig.StateVisibility.NeverReturnExpired)
        # Flink's background cleanup, stated explicitly: PyFlink builds its default RocksDB
        # strategy (even when one is given) with a Duration made through the py4j gateway, which
        # an embedded (thread mode) interpreter on a TaskManager does not have. Same effect.
        .disable_cleanup_in_background()
        .cleanup_incrementally(5, False)
        .cleanup_in_rocksdb_compact_filter(1000, _PeriodicUnused())
        .build()
    )
    return descriptor


class _PeriodicUnused:
    """``periodic_compaction_time`` of the RocksDB compaction-filter TTL cleanup. PyFlink 2.3 never
    passes this value to Java, in either execution mode (Java's default, 30 days, applies), but
    without one it builds ``Duration.of_days(30)`` through the py4j gateway, which fails in thread
    mode on a cluster (``FileNotFoundError`` launching a gateway). So the value is this placeholder."""

    def to_milliseconds(self) -> int:
        return 30 * 24 * 3600 * 1000


def _seconds(n: int) -> Any:
    from pyflink.common.time import Time

    return Time.seconds(n)


def _token_gauge(operator: Any, name: str) -> Callable[[], int]:
    """A gauge of the operator's enricher's ``TokenCounts`` field ``name`` (0 before it starts)."""
    return lambda: round(operator.enricher.tokens.as_dict()[name]) if operator.enricher else 0
