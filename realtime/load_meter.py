"""The request rate the service sees: the capacity controller's input (``realtime.shifting``)."""

from __future__ import annotations

import math

from prompt_assembly.errors import ConfigurationError


class LoadMeter:
    """Requests per second over a sliding window of whole seconds; memory is bounded by the window.

    Seconds count from ``begin`` (the epoch until then). Before the meter has covered its window, the
    rate is the mean over the seconds it has covered: divided by the whole window, a steady load read as
    a ramp from 0, and the capacity controller extrapolated that ramp a minute ahead."""

    def __init__(self, window_s: float = 5.0) -> None:
        if window_s < 1 or window_s != int(window_s):
            raise ConfigurationError(
                f"a load window of {window_s} s (CAPACITY_LOAD_WINDOW_S): the rate is measured over whole "
                "seconds, at least 1"
            )
        self.window_s = int(window_s)
        self._origin = 0.0
        self._buckets: dict[int, int] = {}

    def begin(self, now: float) -> None:
        """Measure from ``now`` (the service's start): no second before it counts as covered, as a
        service that has just started has seen no load yet, which is not a load of 0."""
        self._origin = now
        self._buckets.clear()

    def covered(self, now: float) -> bool:
        """Whether the window holds only seconds measured since ``begin``."""
        return now - self._origin >= self.window_s

    def _second(self, now: float) -> int:
        return math.floor(now - self._origin)

    def hit(self, now: float) -> None:
        second = self._second(now)
        self._buckets[second] = self._buckets.get(second, 0) + 1
        if len(self._buckets) > 4 * self.window_s:
            for old in [s for s in self._buckets if s < second - self.window_s]:
                del self._buckets[old]

    def rate(self, now: float) -> float:
        """Mean rate over the last ``window_s`` full seconds, or over those measured so far (0 before
        the first one ends)."""
        current = self._second(now)
        seconds = range(max(current - self.window_s, 0), current)
        if not seconds:
            return 0.0
        return sum(self._buckets.get(s, 0) for s in seconds) / len(seconds)
