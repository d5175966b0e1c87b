"""Deadline-aware admission: refuse at once, before any work, a request that cannot be answered in time.

A request that arrives after waiting (in the caller, the network, the socket, a lagging event loop)
may already be too old to answer within its deadline, even with the fallback. Answering it anyway
costs the same CPU as a useful answer and lands after the caller gave up; under overload those
answers are what pushes the next ones late too. So the handler asks ``DeadlineAdmission.refusal``
first, and a request that cannot make it gets a ``429 overloaded`` with ``Retry-After`` in a few
microseconds, leaving the CPU to the requests that can.

The estimate, all in seconds:

- ``waited``: how old the request is once its body is read. Its age when its handler started, from
  ``X-Request-Start`` when the caller sends it (``request_age_s``), else the event loop's current lag
  (``LoopLag.current_s``, its worst over the last ~100 ms, about how long a request sat in the socket
  before the loop got to it); plus the time the handler took to read the body;
- ``lag``: that lag again, for the answer's own wait before it is written;
- ``reserve``: ``answer_reserve_ms``, kept back to build and write the answer;
- ``own``: how long the service's own work takes now, the median of recent answers' time not spent
  waiting for the model (the median: lag is counted on its own, and a few slow answers must not
  refuse everyone).

A latch-up is ruled out: refused requests teach nothing, so after ``FORGET_S`` without an answer the
recent times are forgotten and the next requests are admitted and measured again.

A request is refused when ``waited + lag + reserve + own`` exceeds its deadline. A request admitted
gets its model call only within what is left (``realtime.matching``), so it is answered in time either
with the model's ranking or with the fallback.
"""

from __future__ import annotations

import math
import time
from array import array

_EVERY = 32
FORGET_S = 1.0
"""A quantile with no new duration for this long starts over from its initial value."""


class RecentQuantile:
    """A quantile of the last ``window`` durations: the service's own time per answer (the median,
    for admission) or the model's time per answer (p10, ``MODEL_FLOOR_QUANTILE``: a call that cannot
    finish even that fast is not made). Forgotten after ``FORGET_S`` without a new duration
    (``current``), so a value that stopped its own measurements (every request refused, every call
    skipped) cannot stay.

    A fixed ring of floats, re-sorted every ``_EVERY`` observations: no allocation per request, and a
    quantile that follows the host's load within a fraction of a second at a few hundred requests a
    second."""

    def __init__(self, quantile: float = 0.5, window: int = 256, initial_s: float = 0.002) -> None:
        self.quantile = quantile
        self.initial_s = initial_s
        self._ring = array("d", [initial_s] * window)
        self._filled = 0
        self._next = 0
        self._since = 0
        self._last_at = 0.0
        self.quantile_s = initial_s
        """``initial_s`` until ``_EVERY`` durations were seen, then the quantile of those seen."""

    def current(self, now: float) -> float:
        """The quantile, or ``initial_s`` again when nothing was observed for ``FORGET_S``."""
        if self._filled and now - self._last_at > FORGET_S:
            self._filled = self._next = self._since = 0
            self.quantile_s = self.initial_s
        return self.quantile_s

    def observe(self, seconds: float, now: float) -> None:
        self._last_at = now
        ring = self._ring
        ring[self._next] = seconds
        self._next = (self._next + 1) % len(ring)
        self._filled = min(self._filled + 1, len(ring))
        self._since += 1
        if self._since >= _EVERY:
            self._since = 0
            seen = sorted(ring[: self._filled])
            self.quantile_s = seen[int(self.quantile * (len(seen) - 1))]


MODEL_FLOOR_QUANTILE = 0.1
"""The model call is skipped when less time is left than its p10 of recent answers: a call that will be
cut at the deadline costs a replica's work (and a new connection when it does not finish within the
cut grace), and gives nothing. A low quantile, so a model that gets faster is still asked and its new speed
learned."""


class DeadlineAdmission:
    """Whether a request can still be answered within its deadline (pure: the caller passes the
    times)."""

    def __init__(self, answer_reserve_s: float, own: RecentQuantile | None = None) -> None:
        self.answer_reserve_s = answer_reserve_s
        self.own = own or RecentQuantile(0.5)

    def needed_s(self, lag_s: float, now: float) -> float:
        """Time an answer takes from its handler's start to the caller, the model aside."""
        return lag_s + self.answer_reserve_s + self.own.current(now)

    def refusal(self, waited_s: float, deadline_s: float, lag_s: float, now: float) -> float | None:
        """None to admit; else the ``Retry-After`` to send (seconds): about the time the loop needs to
        catch up, at least one second. ``now``: a monotonic clock, the one ``observe`` is given."""
        if waited_s + self.needed_s(lag_s, now) <= deadline_s:
            return None
        return max(1.0, math.ceil(lag_s))


_MAX_SKEW_S = 3600.0
"""An ``X-Request-Start`` further than this from our clock is ignored (a unit or clock mix-up)."""


def request_age_s(header: str | None, now: float | None = None) -> float | None:
    """How long ago the caller says it sent the request, from ``X-Request-Start``, or None.

    The value is a Unix time, optionally prefixed ``t=`` (nginx: ``t=${msec}``), in seconds,
    milliseconds or microseconds (told apart by size, as APM agents do). Clocks of different hosts
    differ: a start in the future counts as age 0, and a value that is not a number, or more than an
    hour away, is ignored."""
    if not header:
        return None
    text = header.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    if value > 1e14:
        value /= 1e6
    elif value > 1e11:
        value /= 1e3
    age = (time.time() if now is None else now) - value
    if abs(age) > _MAX_SKEW_S:
        return None
    return max(age, 0.0)
