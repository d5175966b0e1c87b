"""The capacity shifter: the async shell around ``CapacityController``.

Every ``tick_s`` it reads the real-time request rate (a callable; in the service, its ``LoadMeter``),
asks the controller for a split and publishes it on the ``PoolBoard``; followers on both sides apply
it. Publishing an unchanged split renews its lease, so the split lapses (batch takes the pool) about
``lease_s`` after the shifter's last tick. It runs inside the real-time service (``shopper realtime
serve --shift-capacity``), which owns the load signal; decisions are kept in ``history`` for plots
and logs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from capacity.background import BackgroundLoop, every
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
        # A Redis hiccup leaves the last published split in force; the next tick tries again.
        self._loop = BackgroundLoop(
            "capacity-shifter", lambda: every(self._tick_s, self.tick, log, "capacity shifter")
        )

    def _tick_s(self) -> float:
        return self.controller.settings.tick_s

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
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
