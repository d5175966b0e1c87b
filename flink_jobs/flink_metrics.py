"""Operator metrics that survive PyFlink's threading.

PyFlink counters and distributions go through Beam's metrics container, which is thread-local to the
bundle thread: an increment made on the async operator's event-loop thread is silently dropped. So the
async stages count into plain, lock-protected Python numbers and publish them as *gauges*, which PyFlink
evaluates on the bundle thread at every bundle end. Gauge values must be integers (Beam gauge cells),
so ratios are published in per-mille and latencies in milliseconds.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class LatencyWindow:
    """The last ``size`` samples, for p50/p99 gauges (a histogram without a Java-side reservoir)."""

    def __init__(self, size: int = 2048) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._samples.append(value)

    def quantile(self, q: float) -> float:
        with self._lock:
            data = sorted(self._samples)
        if not data:
            return 0.0
        return data[min(len(data) - 1, int(q * len(data)))]


class OperatorStats:
    """Named monotonic counters and latency windows, safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.windows: dict[str, LatencyWindow] = {}

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def get(self, name: str) -> int:
        with self._lock:
            return self.counts.get(name, 0)

    def observe(self, name: str, value_ms: float) -> None:
        window = self.windows.get(name)
        if window is None:
            with self._lock:
                window = self.windows.setdefault(name, LatencyWindow())
        window.add(value_ms)

    def permille(self, part: str, whole: str) -> int:
        with self._lock:
            total = self.counts.get(whole, 0)
            return 0 if total == 0 else round(1000 * self.counts.get(part, 0) / total)

    def register(
        self, group: Any, counters: list[str], windows: list[str], extra: dict[str, Callable[[], int]]
    ) -> None:
        """Publish on a PyFlink metric group: ``<counter>``, ``<window>_p50_ms``/``_p99_ms``, extras."""
        for name in counters:
            group.gauge(name, _bind(self.get, name))
        for name in windows:
            self.windows.setdefault(name, LatencyWindow())
            group.gauge(f"{name}_p50_ms", _quantile(self, name, 0.5))
            group.gauge(f"{name}_p99_ms", _quantile(self, name, 0.99))
        for name, fn in extra.items():
            group.gauge(name, fn)


def _bind(fn: Callable[[str], int], name: str) -> Callable[[], int]:
    return lambda: fn(name)


def _quantile(stats: OperatorStats, name: str, q: float) -> Callable[[], int]:
    return lambda: round(stats.windows[name].quantile(q))
