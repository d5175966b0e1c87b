"""What the enrichment step does when prompts arrive faster than the fleet answers them:
the settings, and the counts an engine shows. The behaviour is ``docs/overload.md``.

- ``fifo``: the behaviour before this module, every prompt sent at once and answered in order (kept
  as a setting: the benchmark's baseline arm).
- ``latest_wins``: a shopper's newer prompt replaces its older one that still waits for admission, and
  cancels it in flight (``cancel_in_flight``); at most ``max_in_flight`` prompts are at the fleet at
  once, the rest wait where they can still be replaced (``pipeline.admission``).
- ``latest_wins_priority`` (the default): as ``latest_wins``, and purchase and cart prompts are
  admitted before browse pauses; a browse pause that waited ``freshness_target_s`` is dropped as stale.
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
        "is dropped as stale (purchase and cart prompts are never dropped, they go first)",
    )

    @property
    def latest_wins(self) -> bool:
        return self.policy != "fifo"

    @property
    def by_priority(self) -> bool:
        return self.policy == "latest_wins_priority"


@dataclass(slots=True)
class OverloadCounts:
    """Why prompts were not answered by the model, per cause (the engines' metrics and progress line)."""

    superseded_queued: int = 0
    """Replaced by the shopper's newer prompt before they were sent."""
    cancelled_in_flight: int = 0
    """Replaced by the shopper's newer prompt after they were sent: the request was closed."""
    dropped_stale: int = 0
    """Browse pauses that waited past ``freshness_target_s`` for admission."""
    skipped_answered: int = 0
    """Replays answered from the answer ledger, without a call."""
    joined: int = 0
    """A second call of a prompt already in flight in this process, which waited for the first one."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
