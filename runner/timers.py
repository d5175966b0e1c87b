"""Wall-clock deadlines of the pending triggers the embedded runner holds (browse pauses).

A trigger's due time is in *event* time (the session decides it); the runner waits for it on the wall
clock, ``timer_wall_per_event_s`` wall seconds per event second after the shopper's last event. Entries
are never removed when a trigger moves or fires early: a stale entry pops later and
``SessionProcessor.fire_armed`` ignores it unless it was armed for the pending trigger, by its due time
and by the session's prompt version when it was armed (``(epoch, seq)``). The due time alone is not
enough: after a pause fires, a late event makes a new pending pause with the same due time (the newest
event has not moved), and an entry armed before the fire would fire it at once, without its quiet
period, where the Flink job (one timer a shopper, deleted when it fires) waits the whole period.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import Callable


class TimerQueue:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall seconds (tests pass their own)."""
        self._clock = clock
        self._heap: list[tuple[float, int, str, float, tuple[int, int]]] = []
        self._seq = 0
        self._wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def now(self) -> float:
        return self._clock()

    def arm(self, shopper_id: str, due_ts: float, deadline: float, version: tuple[int, int]) -> None:
        """Fire ``shopper_id``'s trigger due at event time ``due_ts`` once the wall clock passes
        ``deadline``, if the session's prompt version is still ``version`` then."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, shopper_id, due_ts, version))
        self._wakeup.set()

    def deadlines(self) -> dict[str, float]:
        """The latest deadline armed for each shopper (what a restart re-armed, for inspection)."""
        in_arming_order = sorted(self._heap, key=lambda entry: entry[1])  # later entries overwrite
        return {shopper_id: deadline for deadline, _, shopper_id, _, _ in in_arming_order}

    def pop_due(self) -> list[tuple[str, float, tuple[int, int]]]:
        """(shopper, due event time, version armed for) of every entry whose deadline has passed,
        earliest first."""
        now = self._clock()
        due: list[tuple[str, float, tuple[int, int]]] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, shopper_id, due_ts, version = heapq.heappop(self._heap)
            due.append((shopper_id, due_ts, version))
        return due

    async def wait(self, longest_s: float = 1.0) -> None:
        """Until the next deadline, a newly armed timer, or ``longest_s``."""
        self._wakeup.clear()
        sleep = min(longest_s, self._heap[0][0] - self._clock()) if self._heap else longest_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.01, sleep)):
                await self._wakeup.wait()

    def clear(self) -> None:
        self._heap.clear()
