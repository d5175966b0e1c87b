"""What the enrichment step does when prompts arrive faster than the fleet answers them:
the settings, and the counts an engine shows. The behaviour is ``docs/overload.md``.

- ``fifo``: the behaviour before this module, every prompt sent at once and answered in order (kept
  as a setting: the benchmark's baseline arm).
- ``latest_wins``: a shopper's newer prompt replaces its older one that still waits for admission, and
  cancels it in flight (``cancel_in_flight``); at most ``max_in_flight`` prompts are at the fleet at
  once, the rest wait where they can still be replaced (``pipeline.admission``).
- ``latest_wins_priority`` (the default): as ``latest_wins``, and purchase and cart prompts are
  admitted before browse pauses; a class with a standing queue is served newest first
  (``lifo_after_s``), and a prompt whose wait passes its class's budget is dropped as stale
  (``freshness_target_s`` for a browse pause, ``urgent_max_wait_s`` for purchase and cart).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel, Field

from pipeline.admission_limit import AdaptiveLimitSettings

OverloadPolicy = Literal["fifo", "latest_wins", "latest_wins_priority"]

DEFAULT_PER_REPLICA_IN_FLIGHT = 64
"""The running batch of one replica: ``max_batch_size`` of the simulator's default configuration
(``serving.simulator.config``) and of our TensorRT-LLM configs; more in flight only queues at the
replica, where a newer prompt can no longer replace it."""


class OverloadSettings(BaseModel):
    policy: OverloadPolicy = Field(
        "latest_wins_priority",
        description="latest_wins_priority (a shopper's newest prompt only, purchase and cart first, a "
        "browse pause past freshness_target_s dropped), latest_wins, or fifo (every prompt sent at once "
        "and answered in order: the behaviour before overload handling, a benchmark arm)",
    )
    cancel_in_flight: bool = Field(
        True,
        description="cancel a shopper's older prompt already sent when a newer one arrives (its request "
        "is closed; the replica frees the slot and keeps the computed prefix for the newer prompt)",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="prompts at the fleet at once, fixed; None = adaptive (below), between the replicas "
        "and replicas x per_replica_in_flight",
    )
    per_replica_in_flight: int = Field(
        DEFAULT_PER_REPLICA_IN_FLIGHT,
        ge=1,
        description="the most one replica runs at once (max_batch_size): the ceiling of the adaptive limit",
    )
    adaptive: AdaptiveLimitSettings = Field(
        default_factory=AdaptiveLimitSettings,
        description="the limit below that ceiling, found from the replicas' queueing "
        "(pipeline.admission_limit); not used when max_in_flight is set",
    )
    freshness_target_s: float = Field(
        5.0,
        gt=0,
        description="latest_wins_priority: a browse-pause prompt waiting for admission longer than this "
        "is dropped as stale",
    )
    urgent_max_wait_s: float | None = Field(
        10.0,
        gt=0,
        description="latest_wins_priority: a purchase or cart prompt waiting for admission longer than "
        "this is dropped as stale (they go first, so only when they alone exceed the fleet); None: never",
    )
    max_backfill: int = Field(
        0,
        ge=0,
        description="latest_wins_priority: prompts past their class's wait budget kept to be answered "
        "once no fresher prompt waits (backfill), at most this many at once per process; past it the "
        "one that has waited longest is dropped as stale; 0 (the default) drops each at its budget. A "
        "shopper's prompt past its budget is its newest (latest wins): dropped, the shopper keeps an old "
        "signal, or none, until a next trigger. Keep it under the Flink job's async capacity (512)",
    )
    lifo_after_s: float | None = Field(
        1.0,
        gt=0,
        description="latest_wins_priority: while a class's oldest waiting prompt has waited longer than "
        "this (a standing queue), the class is admitted newest first; None: always oldest first",
    )

    @property
    def latest_wins(self) -> bool:
        return self.policy != "fifo"

    @property
    def by_priority(self) -> bool:
        return self.policy == "latest_wins_priority"

    def wait_budget_s(self, reason: str) -> float | None:
        """How long a prompt of this trigger may wait for admission before it goes to the backfill (or is
        dropped as stale: ``max_backfill``); None: as long as it takes."""
        if not self.by_priority:
            return None
        return self.freshness_target_s if reason == "browse_pause" else self.urgent_max_wait_s


@dataclass(slots=True)
class OverloadCounts:
    """Why prompts were not answered by the model, per cause (the engines' metrics and progress line)."""

    superseded_queued: int = 0
    """Replaced by the shopper's newer prompt before they were sent."""
    cancelled_in_flight: int = 0
    """Replaced by the shopper's newer prompt after they were sent: the request was closed."""
    dropped_stale: int = 0
    """Prompts that waited past their class's budget for admission (``freshness_target_s`` for a browse
    pause, ``urgent_max_wait_s`` for purchase and cart) and were then dropped: at once with
    ``max_backfill`` 0, else the longest-waiting backfilled prompt when a new one finds it full."""
    skipped_answered: int = 0
    """Replays answered from the answer ledger, without a call."""
    joined: int = 0
    """A second call of a prompt already in flight in this process, which waited for the first one."""
    superseded_upstream: int = 0
    """Refused by a gateway in front of the replicas (409) that had seen the shopper's newer prompt: a
    replay after a crash re-sends prompts the dead process had already superseded there."""
    superseded_answered: int = 0
    """Older than the shopper's newest stored answer (the signal's version, read with the answer
    ledger): a replay of a prompt whose newer sibling was answered before the crash, superseded
    without a call."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class TokenCounts:
    """Tokens of the prompts this process sent, split by whether their answer landed (the engines'
    metrics: ``shopper_llm_tokens{answer="landed"|"not_landed", phase="prefill"|"decode"}``).

    The caller cannot see what a replica computed for a request it closed, so the not-landed side is an
    estimate: its prefill is the prompt's tokens past the prefix it shares with the shopper's previous
    prompt (what the replica would have to compute on a cache hit; the shopper's newer prompt reuses
    the blocks it computed, so even that is an upper bound), its decode the time it spent past
    the landed answers' mean time to first token, at their mean time per output token. The replicas'
    own counters (the simulator's ``/admin/stats``: ``prefill_tokens_computed``, ``decode_tokens``) are
    exact; ``bench.overload`` uses those."""

    landed_prefill: int = 0
    """Uncached prompt tokens of the answers that came back."""
    landed_decode: int = 0
    """Completion tokens of the answers that came back."""
    not_landed_prefill: int = 0
    """Unshared prompt tokens of prompts sent whose answer never came back (cancelled in flight,
    errors)."""
    not_landed_decode: float = 0.0
    """Their completion tokens, estimated from the time they were in flight."""
    _ttft_s: float = 0.0
    _token_s: float = 0.0
    _answers: int = 0

    def landed(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, ttft_s: float, latency_s: float
    ) -> None:
        self.landed_prefill += max(0, prompt_tokens - cached_tokens)
        self.landed_decode += completion_tokens
        self._answers += 1
        weight = 1.0 / min(self._answers, 200)  # the mean of the last ~200 answers
        self._ttft_s += weight * (ttft_s - self._ttft_s)
        per_token = (latency_s - ttft_s) / max(1, completion_tokens - 1)
        self._token_s += weight * (per_token - self._token_s)

    def not_landed(self, new_prompt_tokens: int, in_flight_s: float, max_tokens: int) -> None:
        self.not_landed_prefill += new_prompt_tokens
        if self._answers and self._token_s > 0:
            decoded = (in_flight_s - self._ttft_s) / self._token_s
            self.not_landed_decode += min(float(max_tokens), max(0.0, decoded))

    @property
    def not_landed_share(self) -> float:
        """Share of the tokens (prefill and decode) spent on prompts whose answer never landed."""
        wasted = self.not_landed_prefill + self.not_landed_decode
        total = wasted + self.landed_prefill + self.landed_decode
        return wasted / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "landed_prefill": self.landed_prefill,
            "landed_decode": self.landed_decode,
            "not_landed_prefill": self.not_landed_prefill,
            "not_landed_decode": round(self.not_landed_decode),
        }
