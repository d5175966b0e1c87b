"""How late the event loop runs: the part of a request's wait the service cannot see but can allow for."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from capacity.background import BackgroundLoop


class LoopLag:
    """How late the event loop runs timers, over the last second (a sleep's overshoot).

    On a busy host a request can wait in the socket before its handler starts, and its answer can
    wait again before it is written; the service cannot see those waits, but it can see the loop's
    lag and start answering that much earlier, or refuse at once what it can no longer answer in time
    (``realtime.admission``). A timer every 20 ms: finer adds wake-ups (CPU) and says no more about
    deadlines of hundreds of milliseconds.
    """

    def __init__(self, interval_s: float = 0.02, window: int = 50) -> None:
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._latest: deque[float] = deque(maxlen=5)
        self._loop = BackgroundLoop("loop-lag", self._measure)

    @property
    def recent_s(self) -> float:
        """The worst lag of the last second: what an answer keeps back (cautious, costs little)."""
        return max(self._samples, default=0.0)

    @property
    def current_s(self) -> float:
        """The worst lag of the last five samples (about 100 ms): what admission goes by, since a
        refusal loses an answer, and one hiccup should not refuse a second's requests."""
        return max(self._latest, default=0.0)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _measure(self) -> None:
        while True:  # perf_counter: uvloop's loop.time() counts whole milliseconds
            started = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(time.perf_counter() - started - self.interval_s, 0.0)
            self._samples.append(lag)
            self._latest.append(lag)
