"""The capacity shifter: the async shell around ``CapacityController``.

Every ``tick_s`` it reads the real-time request rate (a callable; in the service, its ``LoadMeter``),
asks the controller for a split and publishes it on the ``PoolBoard``; followers on both sides apply
it. It runs inside the real-time service (``shopper realtime serve --shift-capacity``), which owns the
load signal; decisions are kept in ``history`` for plots and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from capacity.controller import CapacityController, CapacityDecision
from capacity.pool import PoolBoard

log = logging.getLogger(__name__)

HISTORY_KEPT = 10_000
"""Split changes kept for inspection (a day of changes at one a minute fits); older ones are dropped."""


class CapacityShifter:
    def __init__(
        self,
        controller: CapacityController,
        board: PoolBoard,
        rate: Callable[[float], float],
        *,
        forecast: Callable[[float], float | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.controller = controller
        self.board = board
        self.rate = rate
        self.forecast = forecast
        self.clock = clock
        self.history: deque[tuple[float, CapacityDecision]] = deque(maxlen=HISTORY_KEPT)
        self._task: asyncio.Task[None] | None = None

    async def tick(self) -> CapacityDecision:
        now = self.clock()
        ahead = self.forecast(now + self.controller.settings.lead_s) if self.forecast else None
        before = self.controller.realtime
        decision = self.controller.decide(now, self.rate(now), ahead)
        if decision.realtime != before or not self.history:
            log.info("capacity: %s (batch %d)", decision.reason, decision.batch)
        await self.board.publish(decision.realtime, now)
        self.history.append((now, decision))
        return decision

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="capacity-shifter")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:  # Redis hiccup: the last published split stays in force
                log.warning("capacity shifter: %r", exc)
            await asyncio.sleep(self.controller.settings.tick_s)
