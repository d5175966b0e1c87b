"""Prefill/decode disaggregation, routed per shopper: which decode server, and whether to prefill there
or on a context server first (conditional disaggregation).

With P/D a request is split: a *context* (prefill) server computes the prompt's KV cache and first token,
a *generation* (decode) server pulls that cache and decodes the rest, so long prefills no longer stall
the decode batches (what inter-token latency suffers from on an aggregated replica). Every peer that
ships it (TensorRT-LLM's ``conditional_disagg_config``, NVIDIA Dynamo, llm-d) learned that with heavy
prefix reuse the *uncached* part of a prompt is small, and sending it to a context server costs more
(a second queue, a KV transfer) than prefilling it where it will be decoded. Our workload is exactly
that: a shopper's prompts share a long prefix and only the newest events change. So, per request:

1. **Decode server**: ``decode`` (a ``PrefixAwarePolicy`` over the generation servers): load and KV
   headroom (bounded load, queued-token cap), crediting the prefix a server already holds when its block
   reuse is on (``generation_block_reuse``), which keeps a shopper on one decode server while it holds.
2. **Prefill locally** on that server when the part of the prompt it does not hold is at most
   ``max_local_prefill_tokens`` (TensorRT-LLM's ``max_local_prefill_length``), or below
   ``min_remote_share`` of the prompt (Dynamo's ratio, off by default), and, by default, only while
   that server has nothing in flight (``local_only_when_idle``): a local prefill lengthens the decode
   step of every request running there, which is what disaggregation exists to prevent. Optionally
   (``local_when_busy``) also when every context server is busy, trading inter-token latency for the
   first token.
3. Otherwise **a context server**: ``context`` (a ``PrefixAwarePolicy`` over the context servers only),
   with the existing prefix-aware cost.

The client makes the two-step call (``context_only``, then a streamed ``generation_only`` with the
context server's ``disaggregated_params``) and, if the context server's blocks are gone by then
(timeout, restart), redoes the prefill on the decode server instead of failing. Both pools can follow
their servers' KV cache events (``kv_events`` of each part). Pure and synchronous, like every policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from llm_client.endpoints import Endpoint
from llm_client.routing.base import Feedback, RouteOutcome, RouteRequest
from llm_client.routing.prefix_aware import HASHES_MEMO, PrefixAwarePolicy, PrefixAwareSettings

LocalReason = Literal["small", "share", "busy", "no_context"]


class PdAwareSettings(BaseModel):
    """Knobs of ``PdAwarePolicy``; each pool's own choice is a ``PrefixAwareSettings``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["pd_aware"] = "pd_aware"
    decode: PrefixAwareSettings = Field(
        default_factory=PrefixAwareSettings, description="how the decode (generation) server is chosen"
    )
    context: PrefixAwareSettings = Field(
        default_factory=PrefixAwareSettings, description="how the context (prefill) server is chosen"
    )
    generation_block_reuse: bool = Field(
        True, description="the generation servers reuse KV blocks (serving/trtllm/disagg: on): a decode "
        "server is credited with the prefix it holds, and pulls only the blocks it lacks"
    )  # fmt: skip
    max_local_prefill_tokens: int = Field(
        512, ge=0, description="prefill on the decode server when the part of the prompt it does not "
        "hold is at most this many tokens (TensorRT-LLM's max_local_prefill_length); a shopper's newest "
        "events are a few hundred tokens. 0: always remote"
    )  # fmt: skip
    min_remote_share: float = Field(
        0.0, ge=0, le=1, description="... or below this share of the prompt (Dynamo uses 0.7); 0 = off"
    )
    context_busy_tokens: float = Field(
        16384, gt=0, description="a context server whose queued prefill load is at least this is busy; "
        "when every one is, prefill locally (two full 8192-token iterations of waiting)"
    )  # fmt: skip
    local_only_when_idle: bool = Field(
        True, description="a small uncached part is prefilled locally only on a decode server with "
        "nothing in flight: a local prefill lengthens the decode step of everything running there (a "
        "fused iteration grows with the prefill tokens it carries); off, a small "
        "uncached part is prefilled locally whenever it is small enough. Goodput with and without it: "
        "docs/disaggregation.md"
    )  # fmt: skip
    local_when_busy: bool = Field(
        False, description="prefill locally when every context server is busy (TTFT first); off, the "
        "default: queue at the context servers (inter-token latency first: a cold prefill on a decode "
        "server lengthens the step of every request running there; docs/disaggregation.md)"
    )  # fmt: skip


@dataclass
class PdAwareStats:
    """Where each request's prefill went, for benchmarks and ``/metrics``."""

    remote: int = 0
    local_small: int = 0
    local_share: int = 0
    local_busy: int = 0
    local_no_context: int = 0
    redone_locally: int = 0
    """Two-step calls whose context blocks were gone at the pull (or whose context step failed)."""

    @property
    def local_share_of_all(self) -> float:
        local = self.local_small + self.local_share + self.local_busy + self.local_no_context
        total = local + self.remote
        return local / total if total else 0.0


class PdAwarePolicy:
    """``choose`` picks the decode server (the client's retry loop, health and load accounting apply to
    it as to any replica); ``context_for`` says whether and where to prefill first."""

    name: ClassVar[str] = "pd_aware"
    settings_type: ClassVar[type[BaseModel]] = PdAwareSettings

    def __init__(self, settings: PdAwareSettings | None = None, **knobs: Any) -> None:
        if settings is None or knobs:
            base = settings.model_dump() if settings is not None else {}
            settings = PdAwareSettings.model_validate({**base, **knobs})
        self.settings = settings
        self.decode = PrefixAwarePolicy(settings.decode)
        self.context = PrefixAwarePolicy(settings.context)
        self.stats = PdAwareStats()

    # ---- the decode server: the RoutingPolicy the client's loop calls -----------------------------------
    @property
    def kv_event_poll_s(self) -> float | None:
        return self.decode.kv_event_poll_s

    def apply_kv_events(self, endpoint: Endpoint, events: Sequence[Any]) -> None:
        self.decode.apply_kv_events(endpoint, events)

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        return self.decode.choose(request, endpoints)

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        return self.decode.estimate_uncached_tokens(request, endpoint)

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> Feedback:
        return self.decode.observe(request, endpoint, outcome)

    def forget(self, endpoint: Endpoint) -> None:
        self.decode.forget(endpoint)
        self.context.forget(endpoint)

    def prefill_done(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.decode.prefill_done(request, endpoint)

    def prefill_abandoned(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.decode.prefill_abandoned(request, endpoint)

    def attempt_over(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.decode.attempt_over(request, endpoint)

    # ---- the conditional rule and the context server ----------------------------------------------------
    def uncached_on_decode(self, request: RouteRequest, decode: Endpoint) -> int:
        """Prompt tokens ``decode`` would have to prefill itself (all of them without block reuse): what
        it was believed to hold when ``choose`` picked it (``choose`` then records the whole prompt
        there, as it will be once decoded)."""
        if not self.settings.generation_block_reuse:
            return request.prompt_tokens
        return self.decode.estimate_uncached_tokens(request, decode)

    def local_reason(
        self, request: RouteRequest, decode: Endpoint, contexts: Sequence[Endpoint]
    ) -> LocalReason | None:
        """Why ``request`` should be prefilled on ``decode`` itself, or None to prefill remotely."""
        s = self.settings
        if not contexts:
            return "no_context"
        uncached = self.uncached_on_decode(request, decode)
        busy_decoding = s.local_only_when_idle and decode.outstanding > 0  # (this request not yet counted)
        if busy_decoding:
            pass
        elif uncached <= s.max_local_prefill_tokens:
            return "small"
        elif uncached < s.min_remote_share * request.prompt_tokens:
            return "share"
        if s.local_when_busy and all(self.context.load(c) >= s.context_busy_tokens for c in contexts):
            return "busy"
        return None

    def context_for(
        self, request: RouteRequest, decode: Endpoint, contexts: Sequence[Endpoint]
    ) -> tuple[Endpoint, RouteRequest] | None:
        """The context server to prefill ``request`` on before ``decode`` decodes it, with the route of
        that step (its own policy scratch space, the prompt's hashes shared), or None: prefill locally.
        ``contexts``: the routable context servers."""
        reason = self.local_reason(request, decode, contexts)
        if reason is not None:
            setattr(self.stats, f"local_{reason}", getattr(self.stats, f"local_{reason}") + 1)
            return None
        self.stats.remote += 1
        step = replace(request, max_tokens=1, memo={})
        if HASHES_MEMO in request.memo:
            step.memo[HASHES_MEMO] = request.memo[HASHES_MEMO]
        calm = [c for c in contexts if self.context.load(c) < self.settings.context_busy_tokens]
        return self.context.choose(step, calm or contexts), step

    def redone_locally(self) -> None:
        self.stats.redone_locally += 1
