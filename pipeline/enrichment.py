"""Turns a prompt request into exactly one result record: an insight, or an error that says why.

This is the one place where the pipeline meets the model. It never raises for a failed or malformed
answer (the stream must not stop); it returns an ``EnrichmentError`` that sinks store and count. The
answer is checked inside the client (``validate=parse_understanding``), so an answer that is not a
``ShopperUnderstanding`` is tried once more on another replica and counts against the replica that
sent it, instead of becoming an error record while a healthy replica stands by.

Under overload (``pipeline.overload``, ``docs/overload.md``) it is also where a prompt may not be sent:
a recorded answer is returned from the answer ledger (``pipeline.answer_ledger``: never pay twice), a
shopper's newer prompt supersedes its older one (``pipeline.latest_wins``), and an admission gate
(``pipeline.admission``) keeps in flight only what the fleet serves, purchase and cart first. Each of
those prompts still gets its one result: the recorded insight, or a ``Superseded`` record. A prompt that
is sent goes with its ``request_id`` (after the job's scope, before a digest of its messages) as the
idempotency key (``Idempotency-Key``), so a gateway in front of the replicas can join or reuse a
replayed call that the ledger did not catch (one in flight at a crash).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import time
from collections.abc import Awaitable
from typing import Any

import orjson
from pydantic import BaseModel, Field, ValidationError

from llm_client.answer_text import json_object_text, schema_field_errors
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from llm_client.errors import InvalidAnswer, LLMError, SupersededByNewer
from llm_client.hooks import Attempt
from pipeline.admission import BACKFILL_CLASS, BROWSE_CLASS, URGENT_CLASS, AdmissionGate, Evicted
from pipeline.admission_limit import AdaptiveAdmissionLimit
from pipeline.answer_ledger import AnswerLedger
from pipeline.latest_wins import Arrival, Claim, ShopperClaims, cut_soon
from pipeline.overload import OverloadCounts, OverloadSettings, TokenCounts
from prompt_assembly.errors import ConfigurationError
from prompt_assembly.records import (
    EnrichmentError,
    EnrichmentResult,
    PromptRequest,
    ShopperInsight,
    Superseded,
    SupersededCause,
    Usage,
    request_id,
)
from prompt_assembly.understanding import ShopperUnderstanding, response_format, understanding_json_schema


class EnrichmentSettings(BaseModel):
    max_tokens: int = Field(200, ge=16, description="output budget; answers are ~200 tokens")
    deadline_s: float = Field(30.0, gt=0, description="per prompt, retries included")
    guided_json: bool = Field(True, description="send the JSON schema as response_format")
    answer_ledger: bool = Field(
        True,
        description="answer a replayed prompt from the answer ledger (pipeline.answer_ledger) when the "
        "engine provides one, and record each answer there as it arrives",
    )
    overload: OverloadSettings = Field(default_factory=OverloadSettings)


def refuse_reading_on_superseded(llm: ClientConfig, enrichment: EnrichmentSettings) -> None:
    """A stream engine closes a superseded prompt's call so that the replica frees its slot for the
    shopper's newer prompt (``overload.cancel_in_flight``); a cut grace (``llm.timeouts.cut_grace_s``,
    the real-time path's, ``llm_client.cut_calls``) would keep that call reading instead, holding the
    slot through the grace. Raises ``ConfigurationError`` naming both settings, at start."""
    overload = enrichment.overload
    if llm.timeouts.cut_grace_s > 0 and overload.latest_wins and overload.cancel_in_flight:
        raise ConfigurationError(
            f"llm.timeouts.cut_grace_s is {llm.timeouts.cut_grace_s:g} s (LLM_TIMEOUTS__CUT_GRACE_S?): a "
            "superseded prompt's call would read on instead of freeing its replica slot; set it to 0, or "
            "enrichment.overload.cancel_in_flight to false"
        )


class Enricher:
    """One per process (engine worker): its claims and its gate see every prompt the process sends.

    ``ledger``: the answer ledger (``AnswerLedger.from_settings(sink_settings)``); None records nothing
    and reads nothing, so every replayed prompt is sent again. ``scope``: what makes this job's sessions
    and prompts its own at a gateway that other jobs call too (the sinks' key prefix, where the signals
    and the ledger live): it goes before the shopper in the routing key (the gateway's session, which
    a newer version supersedes) and before the ``request_id`` in the idempotency key. Without it, two
    jobs with the same shoppers (a replayed topic, a test) would supersede or join each other's calls."""

    def __init__(
        self,
        client: LLMClient,
        settings: EnrichmentSettings | None = None,
        *,
        ledger: AnswerLedger | None = None,
        scope: str = "",
    ) -> None:
        self.client = client
        self.scope = scope
        self.settings = settings or EnrichmentSettings()
        self.ledger = ledger if self.settings.answer_ledger else None
        overload = self.settings.overload
        self.fleet_limit = AdaptiveAdmissionLimit(
            overload.adaptive,
            lambda: sum(e.replicas_behind for e in client.endpoints),  # a gateway stands for its fleet
            overload.per_replica_in_flight,
        )
        # Never past the client's own slots: a prompt admitted beyond them would wait at the client in
        # arrival order, out of the gate's priority order and its wait budgets, unseen by the limit.
        slots = self._slots = client.config.max_in_flight
        fixed = overload.max_in_flight
        self.gate = AdmissionGate(
            (lambda: min(self.fleet_limit(), slots)) if fixed is None else (lambda: min(fixed, slots)),
            by_priority=overload.by_priority,
            lifo_after_s=overload.lifo_after_s if overload.by_priority else None,
            unbounded_classes=frozenset(
                klass
                for klass, reason in ((URGENT_CLASS, "purchase"), (BROWSE_CLASS, "browse_pause"))
                if overload.wait_budget_s(reason) is None
            ),
        )
        self.claims = ShopperClaims()
        self.counts = OverloadCounts()
        self.tokens = TokenCounts()
        self._supersedes_in_flight = overload.latest_wins and overload.cancel_in_flight
        if _sent not in client.hooks.attempt_started:
            client.hooks.attempt_started.append(_sent)

    async def enrich(self, prompt: PromptRequest) -> EnrichmentResult:
        """Exactly one result for ``prompt``; raises only when the caller's own task is cancelled."""
        if self.ledger is not None:
            known = await self.ledger.lookup(prompt)
            if known.answer is not None:
                self.counts.skipped_answered += 1
                return known.answer.model_copy(update={"replayed": True})
            newest = known.newest_answered
            # fifo answers every prompt, replayed or not
            if self.settings.overload.latest_wins and newest is not None and _outrun(prompt, newest):
                self.counts.superseded_answered += 1
                return _superseded(prompt, "newer_prompt", request_id(prompt.shopper_id, *newest))
        if not self.settings.overload.latest_wins:
            return await self._answer(prompt)
        arrival, displaced, claim = self.claims.arrive(prompt)
        if arrival is Arrival.OLDER:
            self.counts.superseded_queued += 1
            return _superseded(prompt, "newer_prompt", claim.prompt.request_id)
        if arrival is Arrival.SAME:
            return await self._joined(prompt, claim)
        if displaced is not None:
            displaced.displace(prompt, cancel_in_flight=self.settings.overload.cancel_in_flight)
        task = asyncio.create_task(self._admitted(prompt, claim))
        claim.task = task
        try:
            result = await self._outcome(prompt, claim, task)
        finally:
            self.claims.leave(claim)
        if task.cancelled() and claim.superseded_by is not None:
            self._count_displaced(claim)
        return result

    async def recorded_answer(self, prompt: PromptRequest) -> ShopperInsight | None:
        """``prompt``'s answer in the ledger, if any: for a caller whose own timeout cut its ``enrich``,
        as an answer may have come back in the same pass and been kept (``_answer``)."""
        if self.ledger is None:
            return None
        return (await self.ledger.lookup(prompt)).answer

    def _count_displaced(self, claim: Claim) -> None:
        """Counted once its work has stopped, not when displaced: a displaced call whose answer came
        in meanwhile is kept (``Claim.displace``), and lands uncounted."""
        if claim.cancelled_in_flight:
            self.counts.cancelled_in_flight += 1
        else:
            self.counts.superseded_queued += 1

    async def _joined(self, prompt: PromptRequest, claim: Claim) -> EnrichmentResult:
        """The same prompt again while its call is on (a replay): that call's result, marked
        ``replayed`` (this prompt asked the model nothing). When the first caller was cancelled rather
        than displaced (a shutdown, its own timeout), no newer prompt exists and this one is still owed
        an answer: it is asked again, as the shopper's newest."""
        assert claim.task is not None  # set in the same step that made the claim
        self.counts.joined += 1
        result = await self._outcome(prompt, claim, asyncio.shield(claim.task))
        if claim.superseded_by is None and claim.task.cancelled():
            self.counts.joined -= 1
            self.claims.leave(claim)
            return await self.enrich(prompt)
        if isinstance(result, ShopperInsight):
            return result.model_copy(update={"replayed": True})
        return result

    async def _outcome(
        self, prompt: PromptRequest, claim: Claim, work: Awaitable[EnrichmentResult]
    ) -> EnrichmentResult:
        """The result of ``claim``'s work, or ``Superseded`` when that work was cancelled because a
        newer prompt displaced it (a cancellation of the caller itself propagates)."""
        try:
            result = await work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            return _superseded(
                prompt, "newer_prompt", claim.superseded_by, cancelled_in_flight=claim.cancelled_in_flight
            )
        return result

    async def _admitted(self, prompt: PromptRequest, claim: Claim) -> EnrichmentResult:
        """Wait for admission (by priority; past the class's budget, ``OverloadSettings.wait_budget_s``,
        behind every fresher prompt, or dropped: ``max_backfill``), then ask the model holding a slot."""
        overload = self.settings.overload
        arrived = time.perf_counter()
        try:
            async with asyncio.timeout(overload.wait_budget_s(prompt.reason)):
                await self.gate.acquire(self.gate.rank_of(prompt))
        except TimeoutError:
            if not await self._backfilled(overload.max_backfill):
                self.counts.dropped_stale += 1
                return _superseded(prompt, "stale", None)
        admitted = time.perf_counter()
        try:
            _CLAIM.set(claim)  # this task's: ``_sent`` marks it in flight once an attempt starts
            result = await self._answer(prompt, claim, (admitted - arrived) * 1000)
        except asyncio.CancelledError:
            if claim.sent_at is not None and not claim.answer_kept:
                self._not_landed(prompt, claim.sent_at)
            raise
        finally:
            self.gate.release()
        if isinstance(result, ShopperInsight):
            usage = result.usage
            if self.client.config.stream:  # unstreamed, the first token's time is the whole answer's
                token_ms = (result.latency_ms - result.ttft_ms) / max(1, usage.completion_tokens - 1)
                # Demand raises the limit only where the limit is what holds prompts back: past the
                # client's slots it grew on (to 64 a replica), and a cut then took seconds to bite.
                demand = self.gate.waiting > 0 and self.fleet_limit() < self._slots
                self.fleet_limit.observe(result.ttft_ms, demand=demand, token_ms=token_ms)
            self._count_landed(result)
        elif isinstance(result, EnrichmentError) and result.attempts:
            self._not_landed(prompt, claim.sent_at or admitted)
        return result

    async def _backfilled(self, limit: int) -> bool:
        """Admitted from the backfill (True), or let go (False: ``limit`` 0, or a longer-waiting
        backfilled prompt is let go to make room, this one later in its turn). A prompt past its
        budget is its shopper's newest (latest wins): dropped, the shopper's signal would freeze until
        a next trigger that may never come; behind every fresher prompt, it lands once there is room."""
        if limit == 0:
            return False
        if self.gate.waiting_in(BACKFILL_CLASS) >= limit:
            self.gate.evict_oldest(BACKFILL_CLASS)
        try:
            await self.gate.acquire(self.gate.backfill_rank())
        except Evicted:
            return False
        return True

    def _count_landed(self, insight: ShopperInsight) -> None:
        usage = insight.usage
        self.tokens.landed(
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            insight.ttft_ms / 1000,
            insight.latency_ms / 1000,
        )

    def _not_landed(self, prompt: PromptRequest, sent: float) -> None:
        """A prompt sent whose answer will not land: its tokens count as spent for nothing."""
        in_flight_s = time.perf_counter() - sent
        new_tokens = max(0, prompt.prompt_tokens - prompt.shared_prefix_tokens)
        self.tokens.not_landed(new_tokens, in_flight_s, self.settings.max_tokens)

    async def _answer(
        self, prompt: PromptRequest, claim: Claim | None = None, admission_wait_ms: float = 0.0
    ) -> EnrichmentResult:
        """Ask the model; an insight is recorded in the ledger before it is returned (not cancellable
        from then on: it is paid for). The call is a task of its own (a claim holds it, so that a newer
        prompt cancels the call only while it is not done, never an answer already back), shielded
        from the caller: a caller that goes away (its own timeout, a shutdown) has it cut as a newer
        prompt does, ``cut_soon``, so that an answer whose last bytes came in the pass the caller was
        cancelled in is kept and recorded. Cancelled at once, that answer was dropped, and paid for
        again by the replay."""
        call = asyncio.create_task(self._call(prompt, admission_wait_ms))
        if claim is not None:
            claim.call = call
        try:
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            if not call.done():  # the caller went away (the call cut by a newer prompt is done)
                cut_soon(call.cancel)
                await asyncio.wait([call])
            if (
                not call.cancelled()
                and call.exception() is None
                and isinstance(answer := call.result(), ShopperInsight)
            ):
                await self._record(answer)
                if self.ledger is not None:  # it lands from the ledger: a replay, the caller's retry
                    self._count_landed(answer)
                    if claim is not None:
                        claim.answer_kept = True
            raise
        await self._record(result)
        return result

    async def _record(self, result: EnrichmentResult) -> None:
        """An answer into the ledger, shielded: once it is back, the caller going away does not stop it."""
        if self.ledger is not None and isinstance(result, ShopperInsight):
            await asyncio.shield(self.ledger.record(result))

    async def _call(self, prompt: PromptRequest, admission_wait_ms: float) -> EnrichmentResult:
        try:
            completion = await self.client.chat(
                prompt.messages,
                routing_key=self.scope + prompt.shopper_id,
                max_tokens=self.settings.max_tokens,
                response_format=response_format() if self.settings.guided_json else None,
                deadline_s=self.settings.deadline_s,
                prompt_tokens=prompt.prompt_tokens,
                validate=parse_understanding if self.settings.guided_json else parse_unguided_understanding,
                idempotency_key=self._idempotency_key(prompt),
                session_version=self._version_header(prompt),
            )
        except InvalidAnswer as exc:
            return self._error(prompt, "InvalidAnswer", str(exc), exc.attempts, exc.raw)
        except SupersededByNewer as exc:  # a gateway saw this shopper's newer prompt (a replay)
            self.counts.superseded_upstream += 1
            return _superseded(prompt, "newer_prompt", _newer_request_id(prompt, exc.newer_version))
        except LLMError as exc:
            return self._error(prompt, type(exc).__name__, str(exc), attempts=exc.attempts)
        understanding = completion.parsed
        assert isinstance(understanding, ShopperUnderstanding)  # what parse_understanding returns
        return ShopperInsight(
            **_about(prompt),
            understanding=understanding,
            text=understanding.summary,
            model=completion.model,
            replica=completion.endpoint,
            usage=Usage(
                prompt_tokens=completion.prompt_tokens,
                cached_tokens=completion.cached_tokens,
                completion_tokens=completion.completion_tokens,
            ),
            event_count=prompt.event_count,
            ttft_ms=completion.ttft_ms,
            latency_ms=completion.latency_ms,
            attempts=completion.attempts,
            admission_wait_ms=admission_wait_ms,
            produced_at=time.time(),
        )

    def _idempotency_key(self, prompt: PromptRequest) -> str:
        """The job's scope, the ``request_id``, and a digest of the messages. A replay rebuilds the same
        prompt under the same id, except where a wall-clock timer fired it: then the restarted process
        may fire it after more events and build other messages under that id. That is another prompt,
        which must be a call of its own, not the gateway's 422 for a key sent with another body."""
        digest = hashlib.blake2b(orjson.dumps(prompt.messages), digest_size=8).hexdigest()
        return f"{self.scope}{prompt.request_id}:{digest}"

    def _version_header(self, prompt: PromptRequest) -> str | None:
        """The version a gateway supersedes by, only where a newer prompt may cancel this one in
        flight (not under fifo, not with ``cancel_in_flight=False``: there both answers are wanted)."""
        return f"{prompt.session_epoch}.{prompt.seq}" if self._supersedes_in_flight else None

    @staticmethod
    def _error(
        prompt: PromptRequest, error_type: str, message: str, attempts: int, raw: str | None = None
    ) -> EnrichmentError:
        return EnrichmentError(
            **_about(prompt),
            error_type=error_type,
            message=message[:500],
            attempts=attempts,
            produced_at=time.time(),
            raw_answer=None if raw is None else raw[:2000],
        )


def _about(prompt: PromptRequest) -> dict[str, Any]:
    """What every result kind says of the prompt it answers: its identity, version, trigger and events."""
    return {
        "request_id": prompt.request_id,
        "shopper_id": prompt.shopper_id,
        "session_epoch": prompt.session_epoch,
        "seq": prompt.seq,
        "reason": prompt.reason,
        "new_event_ids": prompt.new_event_ids,
        "trimmed_event_ids": prompt.trimmed_event_ids,
        "trimmed_events": prompt.trimmed_events,
        "last_event_ts": prompt.last_event_ts,
        "due_ts": prompt.due_ts,
    }


def _outrun(prompt: PromptRequest, newest: tuple[int, int]) -> bool:
    """Whether the shopper's stored answer ``newest`` is a later prompt of ``prompt``'s own session (a
    replay, outrun). Another session's answer says nothing: after a state loss, a session whose first
    event is late (an offline batch) has a smaller epoch than the lost one, and every prompt of it was
    dropped unsent until the lost session's signal expired, days later (docs/contracts.md)."""
    epoch, seq = newest
    return epoch == prompt.session_epoch and seq > prompt.seq


def _newer_request_id(prompt: PromptRequest, version: str) -> str | None:
    """The ``request_id`` of the shopper's prompt at session version ``version`` (``EPOCH.N`` or ``N``,
    as ``_version_header`` writes it); None when the version does not read as one."""
    epoch, _, seq = version.strip().rpartition(".")
    try:
        return request_id(prompt.shopper_id, int(epoch or 0), int(seq))
    except ValueError:
        return None


def _superseded(
    prompt: PromptRequest,
    cause: SupersededCause,
    superseded_by: str | None,
    *,
    cancelled_in_flight: bool = False,
) -> Superseded:
    return Superseded(
        **_about(prompt),
        cause=cause,
        superseded_by=superseded_by,
        cancelled_in_flight=cancelled_in_flight,
        produced_at=time.time(),
    )


_CLAIM: contextvars.ContextVar[Claim | None] = contextvars.ContextVar("enrichment_claim", default=None)
"""The claim whose call the current task makes (set in ``Enricher._admitted``, which runs in the
claim's own task), so the client's attempt hook knows which prompt it is sending."""


def _sent(attempt: Attempt) -> None:
    """Client hook: the first attempt of a claim's call started, so its prompt is in flight from now
    (before, it was marked at admission, and one still waiting for the client's slot, a routable replica
    or a retry's backoff was displaced as if sent: counted cancelled in flight, its tokens as spent)."""
    claim = _CLAIM.get()
    if claim is not None and not claim.in_flight:
        claim.in_flight = True
        claim.sent_at = time.perf_counter()


UNDERSTANDING_SCHEMA = understanding_json_schema()
"""What every answer is asked to be (``response_format``) and held to (``parse_understanding``)."""


def parse_understanding(text: str, *, schema_sent: bool = True) -> ShopperUnderstanding:
    """Validate a model answer against the schema it was asked for (``understanding_json_schema``: every
    field present, no other, each of its type and within its limits); tolerates a fenced code block
    around the JSON (small models do that). Raises ``InvalidAnswer`` (kind ``schema``). Without
    ``schema_sent`` (``guided_json`` off: the prompt alone describes the answer), the field names are
    the model's to judge: an extra field is ignored and a missing ``occasion`` is none, as the prompt
    allows, instead of an answer refused and its replica counted as failing."""
    body = json_object_text(text)
    if body is None:
        raise InvalidAnswer(f"answer holds no JSON object: {text[:120]!r}", kind="schema", raw=text)
    try:
        answer = orjson.loads(body)
        errors = schema_field_errors(answer, UNDERSTANDING_SCHEMA) if schema_sent else []
        if not errors:
            return ShopperUnderstanding.model_validate(answer)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        errors = [str(exc)]
    message = f"answer is not a valid ShopperUnderstanding: {'; '.join(errors)}"
    raise InvalidAnswer(message, kind="schema", raw=text)


def parse_unguided_understanding(text: str) -> ShopperUnderstanding:
    """``parse_understanding`` for an answer asked for without a schema (``guided_json`` off)."""
    return parse_understanding(text, schema_sent=False)
