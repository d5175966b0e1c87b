"""Records that flow between the stages: prompt requests out of the session logic, and exactly one
result (an insight or an error) back for each of them. ``request_id`` = ``shopper_id:seq`` is the
idempotency key end to end: a replayed trigger produces the same id, so sinks overwrite instead of
duplicating."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from prompt_assembly.understanding import ShopperUnderstanding

ChatMessage = dict[str, str]
TriggerReason = Literal["add_to_cart", "purchase", "browse_pause"]


class PromptRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    shopper_id: str
    seq: int
    """Per-shopper prompt number, strictly increasing: the version that Redis writes compare on."""
    reason: TriggerReason
    messages: list[ChatMessage]
    event_count: int
    last_event_ts: float
    """Event time of the newest event in the prompt; freshness is measured from it."""
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
    seq: int
    reason: TriggerReason
    understanding: ShopperUnderstanding
    text: str
    model: str
    replica: str
    usage: Usage
    event_count: int
    last_event_ts: float
    ttft_ms: float
    latency_ms: float
    attempts: int
    produced_at: float


class EnrichmentError(BaseModel):
    """The one result of a prompt that could not be answered; it is stored and counted, never dropped."""

    kind: Literal["error"] = "error"
    request_id: str
    shopper_id: str
    seq: int
    reason: TriggerReason
    error_type: str
    message: str
    attempts: int
    last_event_ts: float
    produced_at: float
    raw_answer: str | None = None


EnrichmentResult = ShopperInsight | EnrichmentError
