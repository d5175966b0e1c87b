"""How late the event loop runs: the part of a request's wait the service cannot see but can allow for."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class LoopLag:
    """How late the event loop runs timers, over the last second (a sleep's overshoot).

    On a busy host a request can wait in the socket before its handler starts, and its answer can
    wait again before it is written; the service cannot see those waits, but it can see the loop's
    lag and start answering that much earlier.
    """

    def __init__(self, interval_s: float = 0.01, window: int = 100) -> None:
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        return max(self._samples, default=0.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._measure(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.interval_s)
            self._samples.append(max(loop.time() - started - self.interval_s, 0.0))
