"""The admission gate in front of the model: at most ``limit`` prompts at the fleet at once, the rest
wait here, in rank order, where a newer prompt of the same shopper can still replace them.

A rank is ``(class, arrival)``; the smaller class goes first, so ``rank_of`` makes purchase and cart
prompts outrank browse pauses. Within a class the earliest arrival goes first, unless the class has a
standing queue (``lifo_after_s``): while its oldest waiter has waited longer than that, the class is
served newest first (adaptive LIFO, as Facebook's "Fail at Scale" pairs it with CoDel). A queue that
stands means the fleet answers fewer than arrive; served oldest first, every prompt would then wait
the whole queue and land late, whereas newest first lands most of them fresh and leaves the oldest to
their wait budget (the caller drops them as stale: ``Enricher``). With latest wins each shopper has at
most one prompt waiting, so a hot shopper holds no more of the queue than a new one; but while a class
is served newest first, a shopper's next trigger enters at the front, so a shopper who triggers often is
answered more often than one who triggers once (docs/overload.md). Waiting is cancellable at any point
without losing a slot.

The limit is read at every admission, so it follows the fleet: when capacity shifting moves replicas
into or out of the pool (``LLMClient.set_endpoints``), more or fewer prompts are admitted from then on.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prompt_assembly.records import PromptRequest

_CLASS = {"purchase": 0, "add_to_cart": 0, "browse_pause": 1}  # URGENT_CLASS, BROWSE_CLASS
"""Admission class of each trigger: purchase and cart before browse pauses."""

URGENT_CLASS = 0
"""The class of purchase and cart prompts."""
BROWSE_CLASS = 1
"""The class of browse-pause prompts."""

BACKFILL_CLASS = 2
"""Prompts past their class's wait budget (``OverloadSettings.past_budget``): admitted only when no
prompt within its budget waits, and oldest first even while a queue stands. All are past their budget
already; served newest first, a trickle of newer ones kept the oldest waiting, its epoch uncommitted
and its sessions pinned, for as long as the trickle lasted."""

Rank = tuple[int, int]


class Evicted(Exception):
    """A waiting prompt the gate let go without a slot (``AdmissionGate.evict_oldest``)."""


@dataclass(order=True, slots=True)
class _Waiter:
    arrival: int
    enqueued_at: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class AdmissionGate:
    def __init__(
        self,
        limit: Callable[[], int],
        *,
        by_priority: bool,
        lifo_after_s: float | None = None,
        unbounded_classes: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = limit
        self.by_priority = by_priority
        self.lifo_after_s = lifo_after_s
        """A class whose oldest waiter has waited longer than this is served newest first; None: always
        oldest first."""
        self.unbounded_classes = unbounded_classes
        """Classes whose waits no budget bounds (``urgent_max_wait_s`` None): always oldest first. Newest
        first leaves the oldest to its budget; with none, while arrivals kept up with the fleet, the
        oldest prompt waited for good, and with it its epoch's commit."""
        self._clock = clock
        self.active = 0
        self._classes: dict[int, list[_Waiter]] = {}
        """Per class, its waiters by arrival (a cancelled one takes its entry out when its task runs;
        one cancelled but not yet run is skipped if reached first)."""
        self._arrivals = itertools.count()
        self.waiting = 0
        """Prompts waiting for admission now."""
        self.backfilled = 0
        """Prompts moved to the backfill after waiting past their class's budget."""
        self.admitted_newest_first = 0
        """Prompts admitted ahead of older ones of their class, because the class had a standing queue."""

    @property
    def limit(self) -> int:
        """Prompts admitted at once now (at least one)."""
        return max(1, self._limit())

    def class_of(self, prompt: PromptRequest) -> int:
        """Its admission class: purchase and cart 0, browse pauses 1; 0 for all when not by priority."""
        return _CLASS[prompt.reason] if self.by_priority else 0

    def rank_of(self, prompt: PromptRequest) -> Rank:
        """Its place in the queue: (class, arrival)."""
        return (self.class_of(prompt), next(self._arrivals))

    def backfill_rank(self) -> Rank:
        """A place behind every prompt within its wait budget, for one that waited past it."""
        self.backfilled += 1
        return (BACKFILL_CLASS, next(self._arrivals))

    def oldest_wait_s(self, klass: int) -> float:
        """How long the oldest prompt of ``klass`` still waiting has waited (0 when none waits)."""
        queue = self._live(klass)
        return 0.0 if not queue else self._clock() - queue[0].enqueued_at

    def try_acquire(self) -> bool:
        """Take a slot now if one is free and nobody waits (``acquire``'s fast path, without a task: a
        caller deciding several arrivals in one loop tick sees each one taken before the next)."""
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return True
        return False

    async def acquire(self, rank: Rank) -> None:
        """Until a slot is free and no better-ranked prompt waits (``Evicted`` when let go without one).
        Cancelled while waiting, it holds no slot (one granted in the same instant is passed on)."""
        if self.try_acquire():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(rank[1], self._clock(), future)
        bisect.insort(self._classes.setdefault(rank[0], []), waiter)
        self.waiting += 1
        self._fill()  # the limit may have grown since the last release
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():
                self.waiting -= 1
                self._remove(rank[0], waiter)
            elif future.exception() is None:
                self.release()  # granted just as it was cancelled: hand the slot on
            raise  # (evicted just as it was cancelled: evict_oldest counted it already)

    def waiting_in(self, klass: int) -> int:
        """Prompts of ``klass`` waiting now: not those cancelled whose tasks have not yet run to take
        their entries out (counted, a full backfill dropped a prompt it had room for)."""
        return sum(not waiter.future.done() for waiter in self._live(klass))

    def evict_oldest(self, klass: int) -> None:
        """Let the longest-waiting prompt of ``klass`` go without a slot: its ``acquire`` raises
        ``Evicted``. Nothing happens when none of ``klass`` waits."""
        queue = self._live(klass)
        if queue:
            queue.pop(0).future.set_exception(Evicted())
            self.waiting -= 1

    def release(self) -> None:
        """Give a slot back, then admit the best-ranked waiting prompts while slots are free."""
        self.active -= 1
        self._fill()

    def _remove(self, klass: int, waiter: _Waiter) -> None:
        """Take a cancelled ``waiter``'s entry out of its queue. Left until reached, the entries of
        prompts displaced behind a starved live one piled up for as long as an overload lasted, and
        every insort and ``waiting_in`` paid for them."""
        queue = self._classes.get(klass, [])
        i = bisect.bisect_left(queue, waiter)  # absent when trimmed from an end before its task ran
        while i < len(queue) and queue[i].arrival == waiter.arrival:  # ranks given by hand may repeat
            if queue[i] is waiter:
                del queue[i]
                return
            i += 1

    def _live(self, klass: int) -> list[_Waiter]:
        """``klass``'s queue with cancelled waiters trimmed from both ends."""
        queue = self._classes.get(klass, [])
        start = 0
        while start < len(queue) and queue[start].future.done():
            start += 1
        if start:
            del queue[:start]
        while queue and queue[-1].future.done():
            queue.pop()
        return queue

    def _next(self) -> _Waiter | None:
        for klass in sorted(self._classes):
            queue = self._live(klass)
            if not queue:
                continue
            standing = (
                klass != BACKFILL_CLASS
                and klass not in self.unbounded_classes
                and self.lifo_after_s is not None
                and len(queue) > 1
                and self._clock() - queue[0].enqueued_at > self.lifo_after_s
            )
            if standing:
                self.admitted_newest_first += 1
                return queue.pop()
            return queue.pop(0)
        return None

    def _fill(self) -> None:
        while self.active < self.limit and self.waiting:
            waiter = self._next()
            if waiter is None:
                return
            waiter.future.set_result(None)
            self.active += 1
            self.waiting -= 1
