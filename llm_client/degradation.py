"""Degraded-replica detection: take a slow or erroring replica out of rotation, with no engine or human.

Ageing GPUs show up as higher latency or error codes long before they die, and at thousands of GPUs
that happens daily. A replica that still answers ``/health`` is not ejected by the client, so this
detector compares each replica with its peers instead of with a fixed threshold (load and prompt mix
move every replica's latency together; only a drift *relative to the peers* says "this one is sick"):

- latency: an EWMA of end-to-end latency per unit of work (``completion_tokens + prefill_token_weight
  * uncached prompt tokens``), so a replica is not blamed for getting longer prompts or cache misses;
- errors: an EWMA of the failure rate (5xx, timeouts, connection errors).

A replica with at least ``min_samples`` observations whose latency EWMA exceeds ``latency_factor`` x
the peer median, or whose error EWMA exceeds ``error_threshold`` and ``error_factor`` x the peer median,
is *drained* (``Endpoint.drained = True``: no new requests, in-flight ones finish), logged and counted.
After ``cooldown_s`` it is re-admitted on probation: its statistics restart, so it must collect
``min_samples`` fresh observations before it is judged again; a replica drained again soon after is
kept out twice as long (up to ``max_cooldown_s``). The detector never drains a replica when fewer than
``min_routable`` replicas (or fewer than ``1 - max_drained_fraction`` of all) would remain.

The detector is synchronous and does no I/O; time comes from an injectable clock. It lives beside the
client, not in ``llm_client.routing``: it is not a routing policy, it decides which replicas a policy
may choose from. It never writes an ``Endpoint``: ``evaluate`` returns its decisions and the client
applies them (``apply_health_changes``), so the client stays the only writer of replica state.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from llm_client.endpoints import Endpoint

log = logging.getLogger(__name__)


class DegradationSettings(BaseModel):
    enabled: bool = Field(default=True, description="judge replicas at all")
    latency_factor: float = Field(
        default=3.0, gt=1, description="drain above this x the peer median latency/work"
    )
    error_threshold: float = Field(
        default=0.25, gt=0, le=1, description="error EWMA that may drain a replica"
    )
    error_factor: float = Field(
        default=3.0, gt=1, description="... when also this x the peer median error EWMA"
    )
    min_samples: int = Field(default=20, ge=1, description="observations before a replica is judged")
    min_peers: int = Field(default=2, ge=1, description="judged peers needed for a median")
    alpha: float = Field(default=0.1, gt=0, le=1, description="EWMA weight of a new observation")
    prefill_token_weight: float = Field(
        default=0.02, ge=0, description="work of one uncached prompt token, in decode tokens"
    )
    cooldown_s: float = Field(default=30.0, gt=0, description="time out of rotation before probation")
    max_cooldown_s: float = Field(default=600.0, gt=0, description="cap of the doubling cool-down")
    min_routable: int = Field(default=2, ge=1, description="never drain below this many routable replicas")
    max_drained_fraction: float = Field(
        default=0.5, ge=0, le=1, description="never drain more than this share"
    )


@dataclass(frozen=True, slots=True)
class HealthChange:
    """One decision, for logs and tests."""

    endpoint: str
    action: Literal["drained", "readmitted"]
    reason: str


@dataclass(slots=True)
class _ReplicaSignals:
    samples: int = 0
    latency_per_work: float | None = None
    errors: float = 0.0
    drained_at: float | None = None
    cooldown_s: float = 0.0
    drains: int = 0


@dataclass
class DegradationDetector:
    """Feeds on the client's per-attempt outcomes; ``evaluate`` drains and re-admits replicas."""

    settings: DegradationSettings = field(default_factory=lambda: DegradationSettings())
    clock: Callable[[], float] = time.monotonic
    drains: int = 0
    """Replicas drained so far (all replicas together)."""
    readmissions: int = 0
    changes: list[HealthChange] = field(default_factory=list)
    """Every decision so far, oldest first (bounded to the last 1000)."""
    _signals: dict[str, _ReplicaSignals] = field(default_factory=dict)

    def signals(self, endpoint: Endpoint) -> _ReplicaSignals:
        found = self._signals.get(endpoint.name)
        if found is None:
            found = self._signals[endpoint.name] = _ReplicaSignals()
        return found

    def forget(self, endpoint: Endpoint) -> None:
        """``endpoint`` left the fleet (``Fleet.set_endpoints``): its signals go with it, so a replica
        added again under the same address is judged afresh, not on the old process's latencies and
        errors, and addresses that churn (pod IPs) do not pile up."""
        self._signals.pop(endpoint.name, None)

    # ---- observations ------------------------------------------------------------------------------
    def observe_success(
        self,
        endpoint: Endpoint,
        latency_ms: float,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
    ) -> None:
        s = self.signals(endpoint)
        a = self.settings.alpha
        work = max(
            1.0, completion_tokens + self.settings.prefill_token_weight * (prompt_tokens - cached_tokens)
        )
        sample = latency_ms / work
        s.latency_per_work = (
            sample if s.latency_per_work is None else (1 - a) * s.latency_per_work + a * sample
        )
        s.errors *= 1 - a
        s.samples += 1

    def observe_failure(self, endpoint: Endpoint) -> None:
        s = self.signals(endpoint)
        a = self.settings.alpha
        s.errors = (1 - a) * s.errors + a
        s.samples += 1

    # ---- decisions ---------------------------------------------------------------------------------
    def evaluate(self, endpoints: Sequence[Endpoint]) -> list[HealthChange]:
        """Drain replicas that drift from their peers, re-admit those whose cool-down is over.
        ``endpoints`` are one pool of peers doing the same kind of work: every safeguard
        (``min_peers``, ``min_routable``, ``max_drained_fraction``) counts within it. With P/D the fleet
        judges its context servers and its generation servers apart (``Fleet.evaluate_health``)."""
        if not self.settings.enabled:
            return []
        now = self.clock()
        changes = [self._readmit(e, now) for e in endpoints if e.drained and self._cooled_down(e, now)]
        # The decisions of this call, seen as if already applied (the client applies them afterwards).
        drained = {e.name for e in endpoints if e.drained} - {c.endpoint for c in changes}
        peers = self._peers(endpoints, drained)
        for endpoint in endpoints:
            if endpoint.healthy and endpoint.name not in drained:
                reason = self._drift(endpoint, peers, drained)
                if reason is not None and self._may_drain(endpoints, drained):
                    changes.append(self._drain(endpoint, now, reason))
                    drained.add(endpoint.name)
                    peers = self._peers(endpoints, drained)
        self.changes.extend(changes)
        del self.changes[:-1000]
        return changes

    def _judged(self, endpoint: Endpoint) -> bool:
        return self.signals(endpoint).samples >= self.settings.min_samples

    def _peers(self, endpoints: Sequence[Endpoint], drained: set[str]) -> _Peers:
        """The signals of the pool's judged replicas in rotation, sorted once: each replica's peer
        medians are then read from these without its own value, so one evaluation is O(n log n) in the
        pool's size. (Each replica's own list of peers made it O(n²): 1.3 ms an evaluation at 64
        replicas, and every answered call evaluates; ``bench.degradation``.)"""
        latencies: list[float] = []
        errors: list[float] = []
        for endpoint in endpoints:
            if _in_rotation(endpoint, drained):
                s = self.signals(endpoint)
                if s.samples >= self.settings.min_samples:
                    errors.append(s.errors)
                    if s.latency_per_work is not None:
                        latencies.append(s.latency_per_work)
        latencies.sort()
        errors.sort()
        return _Peers(latencies, errors)

    def _drift(self, endpoint: Endpoint, peers: _Peers, drained: set[str]) -> str | None:
        if not self._judged(endpoint):
            return None
        mine = self.signals(endpoint)
        counted = _in_rotation(endpoint, drained)  # its own values are in the lists: left out of its medians
        if len(peers.errors) - counted < self.settings.min_peers:
            return None
        cfg = self.settings
        own_latency = mine.latency_per_work if counted else None
        if mine.latency_per_work is not None and len(peers.latencies) - counted >= cfg.min_peers:
            median = _median_without(peers.latencies, own_latency)
            if median > 0 and mine.latency_per_work > cfg.latency_factor * median:
                return (
                    f"latency {mine.latency_per_work:.2f} ms/token is {mine.latency_per_work / median:.1f}x "
                    f"the peer median {median:.2f}"
                )
        median_errors = _median_without(peers.errors, mine.errors if counted else None)
        if mine.errors > cfg.error_threshold and mine.errors > cfg.error_factor * median_errors:
            return f"error rate {mine.errors:.2f} vs peer median {median_errors:.2f}"
        return None

    def _may_drain(self, endpoints: Sequence[Endpoint], drained: set[str]) -> bool:
        routable = sum(_in_rotation(e, drained) for e in endpoints)
        cfg = self.settings
        return routable - 1 >= cfg.min_routable and len(drained) + 1 <= cfg.max_drained_fraction * len(
            endpoints
        )

    def _drain(self, endpoint: Endpoint, now: float, reason: str) -> HealthChange:
        s = self.signals(endpoint)
        recently = (
            s.drained_at is not None and now - s.drained_at < 2 * s.cooldown_s + self.settings.cooldown_s
        )
        s.cooldown_s = (
            min(self.settings.max_cooldown_s, 2 * s.cooldown_s) if recently else self.settings.cooldown_s
        )
        s.drained_at = now
        s.drains += 1
        self.drains += 1
        log.warning("draining degraded replica %s for %.0f s: %s", endpoint.name, s.cooldown_s, reason)
        return HealthChange(endpoint.name, "drained", reason)

    def _cooled_down(self, endpoint: Endpoint, now: float) -> bool:
        s = self.signals(endpoint)
        return s.drained_at is None or now - s.drained_at >= s.cooldown_s

    def _readmit(self, endpoint: Endpoint, now: float) -> HealthChange:
        s = self.signals(endpoint)
        s.samples, s.latency_per_work, s.errors = 0, None, 0.0
        self.readmissions += 1
        log.warning("re-admitting replica %s on probation after %.0f s drained", endpoint.name, s.cooldown_s)
        return HealthChange(endpoint.name, "readmitted", "cool-down over; on probation")


def apply_health_changes(endpoints: Sequence[Endpoint], changes: Sequence[HealthChange]) -> None:
    """Record the detector's decisions on the replicas (the client's job: it owns ``Endpoint``)."""
    by_name = {e.name: e for e in endpoints}
    for change in changes:
        endpoint = by_name.get(change.endpoint)
        if endpoint is None:
            continue
        endpoint.drained = change.action == "drained"
        if endpoint.drained:
            endpoint.extra["drains"] = endpoint.extra.get("drains", 0.0) + 1


@dataclass(frozen=True, slots=True)
class _Peers:
    """The signals of one pool's judged replicas in rotation, each list sorted."""

    latencies: list[float]
    errors: list[float]


def _median_without(values: list[float], own: float | None) -> float:
    """``statistics.median`` of the sorted ``values`` less one occurrence of ``own`` (None: less
    nothing), without copying them."""
    skip = len(values) if own is None else bisect.bisect_left(values, own)
    n = len(values) - (own is not None)

    def at(index: int) -> float:
        return values[index if index < skip else index + 1]

    middle = n // 2
    return at(middle) if n % 2 else (at(middle - 1) + at(middle)) / 2


def _in_rotation(endpoint: Endpoint, drained: set[str]) -> bool:
    """Serving traffic once this evaluation's drains apply: healthy, not quarantined for bad answers
    (``answer_health``), and not drained. A quarantined replica is neither a peer to compare with nor
    one that would take a drained replica's share."""
    return endpoint.healthy and not endpoint.quarantined and endpoint.name not in drained
