"""Replica bookkeeping: health and load as the client sees them.

An ``Endpoint`` is mutated only by the client (on the event loop), and read by routing policies.
Ejection is immediate on connection failures (a dead replica must stop receiving traffic at once, the
top complaint about affinity routers) and after ``eject_after_failures`` consecutive errors otherwise;
the health checker re-admits a replica when its ``/health`` answers again. A replica whose answers keep
failing validation is quarantined instead, and comes back only through a real completion probe.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class Endpoint:
    url: str
    name: str
    healthy: bool = True
    outstanding: int = 0
    outstanding_prefill_tokens: int = 0
    """Estimated uncached prompt tokens of the requests in flight (set by the policy's estimate) that are
    still waiting for their prefill: a streamed request's share is removed at its first token."""
    outstanding_decode_tokens: int = 0
    consecutive_failures: int = 0
    served: int = 0
    failed: int = 0
    refused: int = 0
    """Attempts it refused for load (HTTP 429): not failures, they count against nothing."""
    ejections: int = 0
    restarts_detected: int = 0
    latency_ewma_ms: float | None = None
    ttft_ewma_ms: float | None = None
    error_ewma: float = 0.0
    drained: bool = False
    """Taken out of rotation as degraded (slow or erroring compared with its peers)."""
    quarantined: bool = False
    """Taken out of rotation for invalid answers (``llm_client.answer_health``) until a probe passes."""
    out_reason: str | None = None
    """Why the replica last left rotation (ejected or quarantined), for logs and ``/metrics``."""
    quarantine_kind: str | None = None
    """The most frequent kind of invalid answer that quarantined it (a metrics label)."""
    invalid_answers: dict[str, int] = field(default_factory=dict)
    """Invalid answers by kind (``InvalidAnswer.kind``)."""
    replicas_behind: int = 1
    """Replicas this address stands for: 1 for a replica; for a gateway, the routable replicas behind it
    as its last answer said (``llm_client.gateway_headers``). The admission limit is sized by it."""
    extra: dict[str, float] = field(default_factory=dict)
    left: bool = False
    """The replica left the fleet (``Fleet.set_endpoints``): an attempt still running on it teaches
    nothing when it ends, so what the fleet forgot of it is not brought back."""
    attempts: dict[asyncio.Task[object], int] = field(default_factory=dict)
    """The tasks with an attempt running on it (``Exchange.completion``), for a withdrawal to cut, each
    with its cancel count when the attempt began (as ``asyncio.timeout`` tells its own cancel apart)."""
    withdrawn: set[asyncio.Task[object]] = field(default_factory=set)
    """Of ``attempts``, those the fleet cut because the replica left (``Fleet.set_endpoints``)."""
    cut_off: bool = False
    """The fleet withdrew it: an attempt reaching it now (a P/D call's generation step, chosen before
    its context step) is moved at once."""

    @property
    def routable(self) -> bool:
        return self.healthy and not self.drained and not self.quarantined

    @property
    def routing_state(self) -> str:
        """``routable``, ``ejected`` (connections or failures), ``drained`` (degraded), or
        ``quarantined_<kind>`` (bad answers): a small set, for ``/metrics`` labels."""
        if not self.healthy:
            return "ejected"
        if self.quarantined:
            return f"quarantined_{self.quarantine_kind}"
        return "drained" if self.drained else "routable"

    def record_success(self, latency_ms: float, ttft_ms: float, alpha: float = 0.1) -> None:
        self.served += 1
        self.consecutive_failures = 0
        self.latency_ewma_ms = _ewma(self.latency_ewma_ms, latency_ms, alpha)
        self.ttft_ewma_ms = _ewma(self.ttft_ewma_ms, ttft_ms, alpha)
        self.error_ewma *= 1 - alpha

    def record_failure(self, alpha: float = 0.1) -> None:
        self.failed += 1
        self.consecutive_failures += 1
        self.error_ewma = self.error_ewma * (1 - alpha) + alpha


def _ewma(current: float | None, sample: float, alpha: float) -> float:
    return sample if current is None else current * (1 - alpha) + sample * alpha


def endpoint_name(url: str) -> str:
    """``host:port[/path]`` of a replica URL, never its ``user:password@`` part: the name goes into logs,
    metrics labels and stored results (``replica``)."""
    return url.split("://", 1)[-1].rstrip("/").rsplit("@", 1)[-1]
