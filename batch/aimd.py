"""Adaptive concurrency for a throughput-first endpoint pool (pure, no I/O, no clock).

An LLM server's throughput grows with the number of requests it holds until its batch is full (the
knee); beyond that, requests only queue: latency grows, throughput does not. Below the knee GPUs idle;
far above it, every request waits and a killed job has more work in flight to redo. The controller
keeps the limit just above the knee, judging one window of completions at a time:

- errors or overload answers (5xx/429, timeouts, retries) above ``error_threshold``: multiplicative
  decrease (``error_backoff``) and leave slow start;
- throughput grew by more than ``growth_threshold`` over the best seen: remember this point, and raise
  the limit (doubling in slow start, then ``increase`` at a time); slow start also ends when
  doubling the limit about doubled latency (the extra requests only queued);
- throughput flat but latency above ``latency_tolerance`` x the latency at the best point: requests
  are queueing for nothing, decrease gently (``latency_backoff``);
- otherwise (flat, latency holds): probe upward additively.

After slow start, throughput and latency are smoothed over windows (EWMA, ``smoothing``) so that one
lucky window does not pass for a new knee: a window of a few hundred completions is noisy by ~5%.

A window in which the limit was never reached (too little work) says nothing about the pool and holds
the limit. The remembered best throughput fades by ``best_decay`` a window, so the controller follows a
pool that lost replicas; ``rescale`` moves the limit with the pool's size when replicas are shifted.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field


class AimdSettings(BaseModel):
    initial_limit: int = Field(16, ge=1, description="concurrency to start from")
    min_limit: int = Field(1, ge=1)
    max_limit: int = Field(4096, ge=1, description="the pool's capacity budget caps this further")
    window_s: float = Field(1.0, gt=0, description="length of one judged window")
    min_samples: int = Field(16, ge=1, description="completions a window needs to be judged")
    increase: float = Field(8.0, gt=0, description="additive step once out of slow start")
    growth_threshold: float = Field(0.08, ge=0, description="relative throughput gain that counts")
    smoothing: float = Field(
        0.3, gt=0, le=1, description="EWMA weight of a new window after slow start (noise filter)"
    )
    latency_tolerance: float = Field(1.3, gt=1, description="latency vs the best point before backing off")
    latency_backoff: float = Field(0.9, gt=0, lt=1)
    error_threshold: float = Field(0.02, ge=0, le=1, description="share of failed calls that backs off")
    error_backoff: float = Field(0.7, gt=0, lt=1)
    best_decay: float = Field(0.02, ge=0, lt=1, description="fading of the remembered best per window")


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one window observed."""

    completions: int
    errors: int
    """Failed calls plus retried attempts: what an overloaded pool answers."""
    duration_s: float
    latency_s: float
    """Median latency of the window's completions."""
    limited: bool
    """Whether in-flight calls reached the limit during the window (else demand, not the pool, bound)."""


@dataclass(frozen=True, slots=True)
class AimdDecision:
    limit: int
    reason: str


class AimdController:
    def __init__(self, settings: AimdSettings | None = None, *, budget: int | None = None) -> None:
        self.settings = settings or AimdSettings()
        self.budget = budget if budget is not None else self.settings.max_limit
        self._limit = self._clamp(self.settings.initial_limit)
        self.slow_start = True
        self.best_rps: float | None = None
        """Best throughput seen, fading by ``best_decay`` a window."""
        self.peak_rps = 0.0
        """Best throughput seen, not fading: only beating it moves the knee."""
        self.knee_latency_s = 0.0
        self.knee_limit = 0
        self._smooth: tuple[float, float] | None = None
        self._previous: tuple[int, float] | None = None
        """(limit, latency) of the last judged slow-start window."""

    @property
    def limit(self) -> int:
        return int(self._limit)

    def _clamp(self, value: float) -> float:
        ceiling = max(self.settings.min_limit, min(self.settings.max_limit, self.budget))
        return min(max(value, float(self.settings.min_limit)), float(ceiling))

    def set_budget(self, budget: int) -> None:
        self.budget = max(1, budget)
        self._limit = self._clamp(self._limit)

    def resize(self, budget: int, factor: float) -> None:
        """The pool changed size by ``factor`` (replicas shifted) and its budget to ``budget``: the limit
        and the knee move with the pool instead of being rediscovered, and only then does the new budget
        cap the limit. (Capped by the new budget first and then scaled, a pool shrunk from three
        replicas to one went from a limit of 300 to 42, not 100, and one grown back never regained it.)"""
        self.budget = max(1, budget)
        self.rescale(factor)
        self._limit = self._clamp(self._limit)

    def rescale(self, factor: float) -> None:
        """The pool changed size by ``factor`` (replicas shifted): move the limit and the knee with it
        instead of rediscovering them."""
        if factor <= 0:
            return
        self._limit = self._clamp(self._limit * factor)
        self.peak_rps *= factor
        self.knee_limit = int(self.knee_limit * factor)
        if self.best_rps is not None:
            self.best_rps *= factor

    def _queueing(self, latency: float) -> bool:
        assert self._previous is not None
        limit_growth = self.limit / max(self._previous[0], 1)
        return limit_growth > 1.2 and latency / max(self._previous[1], 1e-9) > 0.85 * limit_growth

    def update(self, window: WindowStats) -> AimdDecision:
        s = self.settings
        total = window.completions + window.errors
        if total and window.errors >= 2 and window.errors / total > s.error_threshold:
            self.slow_start = False
            self._limit = self._clamp(self._limit * s.error_backoff)
            return AimdDecision(self.limit, f"errors {window.errors}/{total}")
        if window.completions < s.min_samples or window.duration_s <= 0:
            return AimdDecision(self.limit, "too few samples")
        if self.best_rps is not None:
            self.best_rps *= 1 - s.best_decay
        if not window.limited:
            return AimdDecision(self.limit, "demand below the limit")
        rps, latency = window.completions / window.duration_s, window.latency_s
        if not self.slow_start:
            if self._smooth is not None:
                a = s.smoothing
                rps = a * rps + (1 - a) * self._smooth[0]
                latency = a * latency + (1 - a) * self._smooth[1]
            self._smooth = (rps, latency)
        if self.slow_start and self._previous is not None and self._queueing(latency):
            # Doubling the limit doubled latency: the extra requests only queue, the knee is behind.
            self.slow_start = False
            self._limit = self._clamp(max(self._previous[0], self._limit * s.latency_backoff))
            return AimdDecision(self.limit, "slow start ended: latency grew with the limit")
        self._previous = (self.limit, latency)
        if self.best_rps is None or rps > self.best_rps * (1 + s.growth_threshold):
            self.best_rps = rps
            if rps > self.peak_rps * (1 + s.growth_threshold):
                # A genuinely new high: this is the knee's latency and limit, as far as we know.
                self.peak_rps, self.knee_latency_s, self.knee_limit = rps, latency, self.limit
            grown = self._limit * 2 if self.slow_start else self._limit + s.increase
            self._limit = self._clamp(grown)
            return AimdDecision(self.limit, f"throughput grew to {rps:.1f}/s")
        self.slow_start = False
        if latency > self.knee_latency_s * s.latency_tolerance:
            # Queueing for nothing; but never below most of the knee, where throughput would fall.
            floor = 0.8 * self.knee_limit
            self._limit = self._clamp(max(self._limit * s.latency_backoff, min(self._limit, floor)))
            return AimdDecision(self.limit, f"latency {latency:.3f}s without throughput gain")
        self._limit = self._clamp(self._limit + s.increase)
        return AimdDecision(self.limit, "probing")
