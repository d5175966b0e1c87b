"""What a call returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    max_itl_ms: float | None = None
    """The largest gap between two content chunks of a stream (inter-token latency's worst moment for
    this request); None for an answer that was not streamed or had fewer than two chunks."""
    disaggregated_params: dict[str, Any] | None = None
    """What a P/D context server answered a ``context_only`` request with (TensorRT-LLM's protocol)."""
