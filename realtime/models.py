"""The real-time API's wire models (pydantic): what ``POST /v1/match`` takes and returns.

These models are the contract: the service validates with them, the client parses with them, and the
OpenAPI spec (``realtime/openapi.json``) is generated from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CANDIDATES = 50
MIN_DEADLINE_MS = 20
MAX_DEADLINE_MS = 5000
ProductId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\s]+$")]

DegradedReason = Literal["deadline", "llm_unavailable", "overloaded", "invalid_answer", "llm_error"]


class Candidate(BaseModel):
    """A product the ad server already retrieved for this slot."""

    model_config = ConfigDict(extra="forbid")

    product_id: ProductId
    title: Annotated[str, Field(max_length=300)] | None = None
    score: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="the existing ranker's score; used by the fallback ranking"
    )


class MatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shopper_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\s]+$")]
    query: Annotated[str, Field(max_length=500)] = Field(
        "", description="search or page context; may be empty"
    )
    candidates: Annotated[list[Candidate], Field(min_length=1, max_length=MAX_CANDIDATES)]
    # Strict: a JSON integer only. Admission reads the deadline before validation and takes only an
    # integer; a lenient field read "50" or 50.0 as 50, so admission judged one deadline and the match
    # kept another (a late answer where a 429 was due, or a refusal of a request with time to spare).
    deadline_ms: Annotated[int, Field(ge=MIN_DEADLINE_MS, le=MAX_DEADLINE_MS, strict=True)] | None = Field(
        None, description="answer within this many ms of arrival (default: the service's, 300)"
    )

    @field_validator("candidates", mode="before")
    @classmethod
    def _ids_as_candidates(cls, value: object) -> object:
        """A bare product id is accepted as a candidate with no title or score."""
        if isinstance(value, list):
            return [{"product_id": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _unique_ids(self) -> MatchRequest:
        seen: set[str] = set()
        for c in self.candidates:
            if c.product_id in seen:
                raise ValueError(f"candidate {c.product_id!r} appears twice")
            seen.add(c.product_id)
        return self


class RankedCandidate(BaseModel):
    product_id: str
    rank: int = Field(description="1 = best")
    score: float = Field(ge=0, le=1)
    reason: str = Field(description="why this product fits this shopper, in a few words")
    source: Literal["llm", "fallback"]


class SignalsUsed(BaseModel):
    shopper: bool = Field(description="the shopper's signals were found in Redis")
    products: int = Field(description="candidates with product signals in Redis")


class MatchResponse(BaseModel):
    shopper_id: str
    ranked: list[RankedCandidate]
    degraded: bool = Field(description="true when the ranking is the fallback, not the model's")
    degraded_reason: DegradedReason | None = None
    model: str | None = None
    llm_ms: float | None = Field(None, description="time spent waiting for the model")
    elapsed_ms: float = Field(description="time from arrival to answer, inside the service")
    deadline_ms: int
    signals: SignalsUsed


class ErrorDetail(BaseModel):
    loc: str
    msg: str


ErrorType = Literal[
    "invalid_json",
    "validation_error",
    "unauthorized",
    "payload_too_large",
    "rate_limited",
    "not_found",
    "method_not_allowed",
    "unsupported_media_type",
    "overloaded",
    "internal_error",
]


class ErrorInfo(BaseModel):
    type: ErrorType
    message: str
    details: list[ErrorDetail] = []


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"]
    llm_replicas: int = Field(description="replicas in the real-time pool")
    llm_routable: int = Field(description="of which healthy and not drained")
    redis: Literal["ok", "down"]
