"""The request rate the service sees: the capacity controller's input (``realtime.shifting``)."""

from __future__ import annotations


class LoadMeter:
    """Requests per second over a sliding window of whole seconds; memory is bounded by the window."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._buckets: dict[int, int] = {}

    def hit(self, now: float) -> None:
        second = int(now)
        self._buckets[second] = self._buckets.get(second, 0) + 1
        if len(self._buckets) > 4 * self.window_s:
            for old in [s for s in self._buckets if s < second - self.window_s]:
                del self._buckets[old]

    def rate(self, now: float) -> float:
        """Mean rate over the last ``window_s`` full seconds."""
        current = int(now)
        seconds = range(current - int(self.window_s), current)
        return sum(self._buckets.get(s, 0) for s in seconds) / self.window_s
