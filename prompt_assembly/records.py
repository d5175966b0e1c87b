"""Records that flow between the stages: prompt requests out of the session logic, and exactly one
result (an insight or an error) back for each of them.

``request_id`` = ``shopper_id:session_epoch:seq`` is the idempotency key end to end: a replayed
trigger produces the same id, so sinks overwrite instead of duplicating. The version of a shopper's
answer is the pair ``(session_epoch, seq)``, compared in that order: ``seq`` counts the prompts of one
session and ``session_epoch`` names the session (``prompt_assembly.session.session_epoch``), so a
session that restarts after its state was lost gets ids never used before, and its answers outrank
the lost session's."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from prompt_assembly.understanding import ShopperUnderstanding

EventTime = Annotated[float, Field(ge=0, lt=100_000_000_000, allow_inf_nan=False)]
"""Epoch seconds (0: unknown), finite and ten times past an event's own bound (``events.Event.ts``), so
that any time computed from a valid event (a pause's due time) fits: a prompt read from the prompts
topic with an infinite, NaN or absurd time is refused at the edge (dead-lettered), where the S3 sink
could not have dated its partition."""

ChatMessage = dict[str, str]
TriggerReason = Literal["add_to_cart", "purchase", "browse_pause"]


def request_id(shopper_id: str, epoch: int, seq: int) -> str:
    return f"{shopper_id}:{epoch}:{seq}"


class PromptRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    shopper_id: str
    session_epoch: int = 0
    """The session's epoch: the first part of the version (0 for sessions from before epochs)."""
    seq: int
    """Prompt number within the session, strictly increasing: the second part of the version."""
    reason: TriggerReason
    messages: list[ChatMessage]
    event_count: int
    new_event_ids: list[str] = Field(default_factory=list)
    """Ids of the events this prompt is the first of its session to include, in log order: with the
    earlier versions' lists they name every event behind an answer (bounded by
    ``SessionConfig.max_events``)."""
    trimmed_event_ids: list[str] = Field(default_factory=list)
    """Ids of the session's events trimmed from its log (token or event budget) since the previous
    prompt before any prompt took them: with ``new_event_ids`` every event of the session is named by
    some version, in a prompt or as trimmed (bounded by ``SessionConfig.remember_trimmed_ids``)."""
    trimmed_events: int = 0
    """How many such events there were (all of them, where the ids are bounded)."""
    last_event_ts: EventTime
    """Event time of the newest event in the prompt; freshness is measured from it."""
    due_ts: EventTime = 0.0
    """Event time at which the prompt became due: the triggering event's time, or the pending trigger's
    due time (a browse pause, a rate-limited cart add) however late its timer fired. Freshness from
    it tells the trigger policy's own wait (a pause's quiet period) apart from the pipeline's. 0 for
    prompts made before the field existed."""
    prompt_tokens: int
    """Estimate with the project tokenizer (the server's own count comes back in usage)."""
    shared_prefix_tokens: int
    """Estimated tokens shared with this shopper's previous prompt (0 for the first)."""


class Usage(BaseModel):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class ShopperInsight(BaseModel):
    """A successful answer: what ad servers read from Redis and analytics read from S3."""

    kind: Literal["insight"] = "insight"
    request_id: str
    shopper_id: str
    session_epoch: int = 0
    seq: int
    reason: TriggerReason
    understanding: ShopperUnderstanding
    text: str
    model: str
    replica: str
    usage: Usage
    event_count: int
    new_event_ids: list[str] = Field(default_factory=list)
    trimmed_event_ids: list[str] = Field(default_factory=list)
    trimmed_events: int = 0
    last_event_ts: float
    due_ts: float = 0.0
    """The prompt's ``due_ts``: event time at which it became due."""
    ttft_ms: float
    latency_ms: float
    attempts: int
    produced_at: float
    admission_wait_ms: float = 0.0
    """How long it waited at the admission gate (``pipeline.admission``) before it was sent: with
    ``latency_ms``, the time from the prompt becoming due to its answer, apart from the trigger's wait."""
    replayed: bool = False
    """True when this prompt asked the model nothing: its answer was read back from the answer ledger
    (``pipeline.answer_ledger``: replayed after its answer had been recorded), or it joined the same
    prompt's call still in flight. Its usage and timings are that call's, counted once already."""


class EnrichmentError(BaseModel):
    """The one result of a prompt that could not be answered; it is stored and counted, never dropped."""

    kind: Literal["error"] = "error"
    request_id: str
    shopper_id: str
    session_epoch: int = 0
    seq: int
    reason: TriggerReason
    error_type: str
    message: str
    attempts: int
    new_event_ids: list[str] = Field(default_factory=list)
    trimmed_event_ids: list[str] = Field(default_factory=list)
    trimmed_events: int = 0
    last_event_ts: float
    due_ts: float = 0.0
    """The prompt's ``due_ts``: event time at which it became due."""
    produced_at: float
    raw_answer: str | None = None


SupersededCause = Literal["newer_prompt", "stale"]
"""``newer_prompt``: the same shopper's newer prompt arrived first (latest wins); ``stale``: it waited
for admission past its class's budget and was then dropped rather than computed
(``pipeline.overload.OverloadSettings.max_backfill``)."""


class Superseded(BaseModel):
    """The one result of a prompt that was not answered on purpose (``pipeline.overload``): a newer
    prompt of the same shopper replaced it, or it waited past the freshness target. It is counted, so
    that prompts = insights + errors + superseded, and never written over a shopper's signal."""

    kind: Literal["superseded"] = "superseded"
    request_id: str
    shopper_id: str
    session_epoch: int = 0
    seq: int
    reason: TriggerReason
    cause: SupersededCause
    superseded_by: str | None = None
    """The ``request_id`` of the newer prompt that replaced it (None when dropped as stale)."""
    cancelled_in_flight: bool = False
    """True when its request had already been sent and was cancelled (the HTTP request closed)."""
    new_event_ids: list[str] = Field(default_factory=list)
    trimmed_event_ids: list[str] = Field(default_factory=list)
    trimmed_events: int = 0
    last_event_ts: float
    due_ts: float = 0.0
    """The prompt's ``due_ts``: event time at which it became due."""
    produced_at: float


EnrichmentResult = ShopperInsight | EnrichmentError | Superseded

_RESULT: TypeAdapter[EnrichmentResult] = TypeAdapter(
    Annotated[ShopperInsight | EnrichmentError | Superseded, Field(discriminator="kind")]
)


def parse_result(raw: str | bytes) -> EnrichmentResult:
    """A result record from its JSON, whichever kind it is (``kind`` says which)."""
    return _RESULT.validate_json(raw)
