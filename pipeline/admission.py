"""The admission gate in front of the model: at most ``limit`` prompts at the fleet at once, the rest
wait here, in rank order, where a newer prompt of the same shopper can still replace them.

A rank is compared as a tuple, smallest first; ``rank_of`` makes purchase and cart prompts outrank
browse pauses and, within a class, the earliest arrival (the oldest due) goes first. A hot shopper
cannot starve new ones: with latest wins each shopper has at most one prompt waiting, so a class is
served round the shoppers in arrival order. Waiting is cancellable at any point without losing a slot.

The limit is read at every admission, so it follows the fleet: when capacity shifting moves replicas
into or out of the pool (``LLMClient.set_endpoints``), more or fewer prompts are admitted from then on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from prompt_assembly.records import PromptRequest

_CLASS = {"purchase": 0, "add_to_cart": 0, "browse_pause": 1}
"""Admission class of each trigger: purchase and cart before browse pauses."""

Rank = tuple[int, int]


class AdmissionGate:
    def __init__(self, limit: Callable[[], int], *, by_priority: bool) -> None:
        self._limit = limit
        self.by_priority = by_priority
        self.active = 0
        self._waiters: list[tuple[Rank, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self.waiting = 0
        """Prompts waiting for admission now."""

    @property
    def limit(self) -> int:
        """Prompts admitted at once now (at least one)."""
        return max(1, self._limit())

    def rank_of(self, prompt: PromptRequest) -> Rank:
        """Its place in the queue: (class, arrival); the class is 0 for all when not by priority."""
        return (_CLASS[prompt.reason] if self.by_priority else 0, next(self._arrivals))

    async def acquire(self, rank: Rank) -> None:
        """Until a slot is free and no better-ranked prompt waits. Cancelled while waiting, it holds
        no slot (one granted in the same instant is passed on)."""
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (rank, future))
        self.waiting += 1
        self._fill()  # the limit may have grown since the last release
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted just as it was cancelled: hand the slot on
            else:
                self.waiting -= 1  # its entry stays in the heap, done, and is skipped by release
            raise

    def release(self) -> None:
        """Give a slot back, then admit the best-ranked waiting prompts while slots are free."""
        self.active -= 1
        self._fill()

    def _fill(self) -> None:
        while self.active < self.limit and self._waiters:
            _, future = heapq.heappop(self._waiters)
            if not future.done():  # a waiter cancelled meanwhile is skipped
                future.set_result(None)
                self.active += 1
                self.waiting -= 1
