"""Capacity shifting between the real-time and batch pools: the decision logic (pure, no I/O, no clock).

Real-time traffic has a predictable daily peak; batch has unlimited patient work. One set of replicas
serves both: real-time gets what its load needs plus headroom, batch gets the rest. The controller
sees real-time requests per second at regular ticks and decides how many replicas real-time holds:

- projected load = the current rate, plus the recent trend (least squares over ``trend_window_s``)
  extrapolated ``lead_s`` ahead when it is rising, plus an optional forecast (e.g. yesterday's curve);
  replicas take time to hand over, so real-time scales up *before* the peak arrives;
- needed = ceil(projected x (1 + ``headroom``) / ``per_replica_rps``), within the floors;
- more needed than held: scale up at once, all the way;
- fewer needed: give replicas back to batch one at a time, only after the need has stayed lower for
  ``scale_down_after_s`` (no flapping on a dip), and at most one per ``step_interval_s``.

Invariants (property-tested): real-time never holds fewer than ``realtime_floor`` replicas, batch never
fewer than ``batch_floor``, the two always add up to the pool, and real-time never drops below what
the *current* load needs with headroom (only projected capacity is given back).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_LEASE_S = 10.0
"""A published split's lease unless ``CAPACITY_LEASE_S`` says otherwise (or three ticks, if longer)."""


class CapacitySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPACITY_")

    per_replica_rps: float = Field(30.0, gt=0, description="real-time requests/s one replica serves in time")
    headroom: float = Field(0.3, ge=0, description="provision this share above the projected load")
    lead_s: float = Field(60.0, ge=0, description="how far ahead the rising trend is projected")
    trend_window_s: float = Field(60.0, gt=0, description="history the trend is fitted on")
    realtime_floor: int = Field(1, ge=1, description="real-time never holds fewer replicas (never starved)")
    batch_floor: int = Field(0, ge=0, description="batch never holds fewer replicas")
    scale_down_after_s: float = Field(60.0, ge=0, description="need must stay lower this long to give back")
    step_interval_s: float = Field(10.0, ge=0, description="at most one replica given back per interval")
    tick_s: float = Field(1.0, gt=0, description="how often the shifter measures and decides")
    load_window_s: float = Field(5.0, gt=0, description="the rate is measured over this window")
    handoff_s: float = Field(2.0, ge=0, description="a replica leaving batch joins real-time after this")
    lease_s: float | None = Field(
        None,
        gt=0,
        description="a published split lapses (batch takes the pool) unless renewed within this; "
        "unset: the larger of 10 s and three ticks",
    )

    @model_validator(mode="after")
    def _positive_lead(self) -> CapacitySettings:
        if self.trend_window_s < 2 * self.tick_s:
            raise ValueError("trend_window_s must cover at least two ticks")
        return self

    @model_validator(mode="after")
    def _lease_outlasts_ticks(self) -> CapacitySettings:
        # Every tick renews the lease: a lease of three ticks survives a slow or failed tick or two.
        if self.lease_s is not None and self.lease_s < 3 * self.tick_s * (1 - 1e-9):  # 3 x 0.2: 0.6000..01
            raise ValueError(
                f"lease_s ({self.lease_s:g}) must cover at least three ticks "
                f"(3 x tick_s = {3 * self.tick_s:g})"
            )
        return self

    @property
    def split_lease_s(self) -> float:
        """The lease a published split is given: ``lease_s``, or unset, the larger of 10 s and three ticks
        (so that a longer ``tick_s`` alone never makes the settings invalid)."""
        return self.lease_s if self.lease_s is not None else max(DEFAULT_LEASE_S, 3 * self.tick_s)

    @property
    def held_remembered_s(self) -> float:
        """How long the count real time last held outlives the renewals: the lease, then
        ``scale_down_after_s``, the least time a running shifter would have kept that count anyway."""
        return self.split_lease_s + self.scale_down_after_s


@dataclass(frozen=True, slots=True)
class CapacityDecision:
    realtime: int
    batch: int
    rate_rps: float
    projected_rps: float
    needed: int
    reason: str


class CapacityController:
    def __init__(self, settings: CapacitySettings, total_replicas: int) -> None:
        if settings.realtime_floor + settings.batch_floor > total_replicas:
            raise ValueError(
                f"floors ({settings.realtime_floor} real-time + {settings.batch_floor} batch) exceed the "
                f"{total_replicas} replicas of the pool"
            )
        self.settings = settings
        self.total = total_replicas
        self.realtime = settings.realtime_floor
        self._history: deque[tuple[float, float]] = deque()
        self._lower_since: float | None = None
        self._last_step_down = -math.inf

    @property
    def batch(self) -> int:
        return self.total - self.realtime

    def _replicas_for(self, rps: float) -> int:
        s = self.settings
        wanted = math.ceil(max(rps, 0.0) * (1 + s.headroom) / s.per_replica_rps - 1e-9)
        return min(max(wanted, s.realtime_floor), self.total - s.batch_floor)

    def _slope(self) -> float:
        """Least-squares slope of the rate over the trend window (requests/s per second)."""
        n = len(self._history)
        if n < 3:
            return 0.0
        mean_t = sum(t for t, _ in self._history) / n
        mean_r = sum(r for _, r in self._history) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._history)
        if var <= 0:
            return 0.0
        return sum((t - mean_t) * (r - mean_r) for t, r in self._history) / var

    def decide(self, now: float, rate_rps: float, forecast_rps: float | None = None) -> CapacityDecision:
        """Record the measured real-time rate at ``now`` and return the split to apply."""
        s = self.settings
        self._history.append((now, rate_rps))
        while self._history and self._history[0][0] < now - s.trend_window_s:
            self._history.popleft()
        projected = rate_rps + max(self._slope(), 0.0) * s.lead_s
        if forecast_rps is not None:
            projected = max(projected, forecast_rps)
        # projected >= rate_rps, so ``needed`` covers the current load too: giving back down to it
        # never leaves real-time short of what it serves right now.
        needed = self._replicas_for(projected)

        if needed > self.realtime:
            before, self.realtime = self.realtime, needed
            self._lower_since = None
            reason = f"scale up {before}->{needed} for {projected:.1f} req/s projected"
        elif needed < self.realtime:
            if self._lower_since is None:
                self._lower_since = now
            held = now - self._lower_since
            if held >= s.scale_down_after_s and now - self._last_step_down >= s.step_interval_s:
                before = self.realtime
                self.realtime = max(self.realtime - 1, needed)
                self._last_step_down = now
                reason = f"give back {before}->{self.realtime} after {held:.0f} s lower"
            else:
                reason = f"hold {self.realtime} (need {needed} for {held:.0f} s)"
        else:
            self._lower_since = None
            reason = f"hold {self.realtime}"
        return CapacityDecision(self.realtime, self.batch, rate_rps, projected, needed, reason)
