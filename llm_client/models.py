"""What a call returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    model: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    """Time to first content token (equals latency for non-streamed calls)."""
    latency_ms: float
    attempts: int
    finish_reason: str | None
    parsed: object = None
    """What the caller's ``validate`` returned for ``text`` (None without one)."""
