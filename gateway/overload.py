"""Overload answered early, by priority: the gateway's admission in front of the replicas.

At most ``limit`` requests are at the replicas at once (routable replicas x ``per_replica_in_flight``,
or ``max_in_flight``); more wait in ``pipeline.admission.AdmissionGate``, ranked ``(class, arrival)``:
``high`` before ``normal`` before ``low``, and in arrival order within a class. The wait is bounded, so
the queue never grows without bound:

- **predicted**: the gateway measures how long a request holds its slot (a moving average); a request
  whose wait, at its place in the queue, would pass its class's ``max_wait_s`` is refused at once;
- **queue full** (``max_waiting``): a request arriving to a full queue pushes out the newest waiter of
  a lower class, else it is refused itself;
- **waited**: a request still waiting after its class's ``max_wait_s`` is refused then.

A refusal is ``Refused`` (answered 429 with ``Retry-After``). ``low`` has the shortest bound and is the
first pushed out, so under overload the lower classes are refused first.

The decision on arrival (``judge``) and the place it finds (``enter``: a free slot, or a place in the
queue) are taken by the request's handler in one synchronous step, before its flight's task runs: taken
in that task, requests arriving in the same loop tick were each judged without the ones before them,
which had not queued yet (a session's newer version admitted, its older call superseded, then the newer
one refused for the place another request of the tick took).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewaySettings, Priority
from llm_client.errors import DeadlineExceeded
from pipeline.admission import AdmissionGate
from prompt_assembly.errors import ShopperError

PRIORITY_CLASS: dict[Priority, int] = {"high": 0, "normal": 1, "low": 2}
"""Rank of each priority: the smaller first."""

HOLD_SMOOTHING = 0.2
"""Weight of the newest slot-hold time in the moving average the predicted wait uses."""


class Refused(ShopperError):
    """The gateway will not queue this request: answered 429 with ``Retry-After``."""

    def __init__(self, priority: Priority, reason: str, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.priority = priority
        self.reason = reason
        """``predicted_wait``, ``queue_full``, ``pushed_out`` or ``waited``."""
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header: whole seconds, at least one."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(eq=False, slots=True)
class Entry:
    """A request's place at admission, taken on arrival (``Admission.enter``): a slot held at once
    (``task`` None), or a place in the queue. Its flight's task takes it over (``Admission.slot``); one
    whose task ended before it ran gives it back through ``Admission.leave``."""

    priority: Priority
    klass: int
    arrival: int
    entered_at: float
    """``time.monotonic()`` on arrival: the class's wait bound counts from here."""
    task: asyncio.Task[None] | None
    """Its ``AdmissionGate.acquire``; None when it took a free slot on arrival."""
    owner: asyncio.Task[Any] | None = None
    """The task waiting (the flight's): cancelled when the request is superseded."""
    refusal: Refused | None = None
    taken: bool = False
    """Its flight's task took it over, or ``leave`` gave it back: what it holds is handled once."""

    @property
    def live(self) -> bool:
        """Still waiting: not granted, not refused, not being stopped (a cancellation is handled
        on the owner's next step, so the gate's own count still includes it for a moment)."""
        return (
            self.task is not None
            and self.refusal is None
            and not self.task.done()
            and (self.owner is None or not self.owner.cancelling())
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admission's decision for a request arriving now (``Admission.judge``), for ``Admission.enter``
    in the same synchronous step: nothing awaited between, so what it counted still holds."""

    priority: Priority
    refusal: Refused | None = None
    """Refused at once (counted already): the request gets no place."""
    victim: Entry | None = None
    """The waiter a full queue pushes out to make this request's place."""
    free: bool = False
    """A slot is free and nobody waits: the request takes it at once."""


class Admission:
    def __init__(
        self,
        settings: GatewaySettings,
        routable_replicas: Callable[[], int],
        on_refused: Callable[[Refused], None] = lambda _: None,
    ) -> None:
        self.settings = settings
        self._routable = routable_replicas
        self.gate = AdmissionGate(self._limit, by_priority=True)
        self._arrivals = itertools.count()
        self._waiters: set[Entry] = set()
        self._on_refused = on_refused
        self.mean_hold_s: float | None = None
        """Moving average of how long a request holds its slot (None until one has ended)."""

    def _limit(self) -> int:
        if self.settings.max_in_flight is not None:
            return self.settings.max_in_flight
        return max(1, self._routable()) * self.settings.per_replica_in_flight

    @property
    def limit(self) -> int:
        return self.gate.limit

    @property
    def max_waiting(self) -> int:
        return self.settings.max_waiting if self.settings.max_waiting is not None else self.limit

    def waiting(self, priority: Priority) -> int:
        return sum(1 for w in self._waiters if w.priority == priority and w.live)

    def predicted_wait_s(self, priority: Priority) -> float | None:
        """How long a request of ``priority`` arriving now would wait: the waiters it queues behind
        (its class and better) plus itself, served ``limit`` at a time, each round one mean hold."""
        klass = PRIORITY_CLASS[priority]
        return self._predicted(sum(1 for w in self._waiters if w.klass <= klass and w.live))

    def judge(
        self, priority: Priority, leaving: asyncio.Task[Any] | None = None, *, frees_slot: bool = False
    ) -> Verdict:
        """What a request of ``priority`` arriving now gets: a free slot, a place in the queue (maybe
        pushing out a lower class), or a refusal at once (its predicted wait past its class's bound, or
        a full queue with no lower class to push out), counted when given. ``leaving``: the task of a
        call the request supersedes, whose place in the queue it frees; ``frees_slot``: that call was
        sent and is being cancelled, so its slot goes to the best waiter. The gateway asks before it
        supersedes: a newer version refused after had cost the older call too, and left the session
        with no call at all. Enter the verdict (``enter``) before anything is awaited."""
        if self._free():
            return Verdict(priority, free=True)
        refusal, victim, _ = self._arrival(priority, leaving, frees_slot)
        if refusal is not None:
            self._on_refused(refusal)
        return Verdict(priority, refusal, victim)

    def enter(self, verdict: Verdict) -> Entry:
        """Take the place ``verdict`` found, at once, so the next arrival of this loop tick counts it: a
        free slot, or a place in the queue (pushing ``verdict.victim`` out for it)."""
        if verdict.refusal is not None:
            raise ValueError("a refused request has no place to enter")
        klass = PRIORITY_CLASS[verdict.priority]
        rank = (klass, next(self._arrivals))
        if verdict.free:
            if not self.gate.try_acquire():  # judged free in this same step: it still is
                raise RuntimeError("a slot judged free was taken before it was entered")
            return Entry(verdict.priority, klass, rank[1], time.monotonic(), None)
        if verdict.victim is not None:
            self._push_out(verdict.victim, verdict.priority)
        task = asyncio.create_task(self.gate.acquire(rank))
        entry = Entry(verdict.priority, klass, rank[1], time.monotonic(), task)
        self._waiters.add(entry)
        return entry

    def leave(self, entry: Entry) -> None:
        """Give back what ``entry`` holds if its flight's task never took it over (cancelled before its
        first step: superseded, its caller gone, or the gateway stopping, in the tick it arrived)."""
        if entry.taken:
            return
        entry.taken = True
        entry.owner = None
        self._waiters.discard(entry)
        task = entry.task
        if task is None:
            self.gate.release()  # the free slot it took on arrival
        elif not task.done():
            task.cancel()  # the gate hands on a slot granted in the meantime
        elif not task.cancelled() and task.exception() is None:
            self.gate.release()  # granted, and nobody to use it

    def _free(self) -> bool:
        """A slot is free and nobody waits for one: neither in the gate nor entered here and not yet
        in the gate (its ``acquire`` task not run yet), whose place a newcomer would otherwise take."""
        gate = self.gate
        return gate.active < gate.limit and not gate.waiting and not any(w.live for w in self._waiters)

    def _arrival(
        self, priority: Priority, leaving: asyncio.Task[Any] | None, frees_slot: bool
    ) -> tuple[Refused | None, Entry | None, float | None]:
        """(the refusal at once, or None; the waiter to push out of a full queue, or None; the predicted
        wait) for a request of ``priority`` arriving to a gate with no free slot."""
        klass = PRIORITY_CLASS[priority]
        live = sorted(
            (w for w in self._waiters if w.live and w.owner is not leaving),
            key=lambda w: (w.klass, w.arrival),
        )
        if frees_slot:
            if not live or live[0].klass > klass:
                return None, None, None  # the freed slot is this request's: none waits, or none as good
            live.pop(0)  # the best waiter takes the freed slot
        ahead = sum(1 for w in live if w.klass <= klass)
        bound = self.settings.wait_bound_s(priority)
        predicted = self._predicted(ahead)
        if predicted is not None and predicted > bound:
            return self._predicted_refusal(priority, predicted, bound), None, predicted
        if len(live) < self.max_waiting:
            return None, None, predicted
        lower = [w for w in live if w.klass > klass]
        if not lower:
            return self._full_refusal(priority, predicted), None, predicted
        return None, max(lower, key=lambda w: (w.klass, w.arrival)), predicted

    def _predicted(self, ahead: int) -> float | None:
        """The wait behind ``ahead`` waiters, served ``limit`` at a time, each round one mean hold."""
        return None if self.mean_hold_s is None else (ahead + 1) / self.limit * self.mean_hold_s

    def _predicted_refusal(self, priority: Priority, predicted: float, bound: float) -> Refused:
        return Refused(
            priority,
            "predicted_wait",
            predicted,
            f"overloaded: a {priority}-priority request would wait about {predicted:.1f} s "
            f"for a replica slot, over its {bound:g} s bound",
        )

    def _full_refusal(self, priority: Priority, predicted: float | None) -> Refused:
        retry = predicted if predicted is not None else self.settings.wait_bound_s(priority)
        return Refused(
            priority,
            "queue_full",
            retry,
            f"overloaded: {self.max_waiting} requests of {priority} priority or higher wait for "
            f"a replica slot (at most {self.max_waiting})",
        )

    @contextlib.asynccontextmanager
    async def slot(self, entry: Entry, within_s: float | None = None) -> AsyncIterator[None]:
        """Hold ``entry``'s slot for the block, once granted. Raises ``Refused`` when its class's bound
        passes first, ``DeadlineExceeded`` when ``within_s`` (what is left of the request's deadline)
        does. Cancelled while waiting, holds nothing."""
        entry.taken = True
        try:
            await self._granted(entry, within_s)
        finally:
            # Needed only while it waits. Held after, it closed a reference cycle through the frames
            # of an error this task ends with (its traceback holds the frame that holds the entry).
            entry.owner = None
        started = time.monotonic()
        try:
            yield
        finally:
            self.gate.release()
            held = time.monotonic() - started
            previous = self.mean_hold_s
            self.mean_hold_s = held if previous is None else previous + HOLD_SMOOTHING * (held - previous)

    async def _granted(self, entry: Entry, within_s: float | None) -> None:
        """Until ``entry`` holds a slot (at once if it took a free one on arrival)."""
        task = entry.task
        if task is None:
            return
        bound = self.settings.wait_bound_s(entry.priority)
        left_s = bound - (time.monotonic() - entry.entered_at)
        deadline_first = within_s is not None and within_s < left_s
        timeout = left_s if within_s is None else min(left_s, within_s)
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
        except asyncio.CancelledError:  # superseded, its caller gone, or the gateway is stopping
            if await _stop(task):
                self.gate.release()  # granted in the same instant: hand the slot on
            raise
        finally:
            self._waiters.discard(entry)
        if not done and await _stop(task):
            return  # granted just as the bound passed: take it
        if not task.cancelled():
            return
        refusal, entry.refusal = entry.refusal, None  # not held past here: raised, it holds this frame
        if refusal is None and deadline_first:
            raise DeadlineExceeded("the request's deadline passed while it waited for a replica slot")
        priority = entry.priority
        self._refuse(
            refusal
            or Refused(
                priority,
                "waited",
                self.predicted_wait_s(priority) or bound,
                f"overloaded: a {priority}-priority request waited {bound:g} s for a replica slot",
            )
        )

    def _push_out(self, victim: Entry, priority: Priority) -> None:
        """Make room in a full queue by refusing ``victim``, the newest waiter of its lowest class."""
        victim.refusal = Refused(
            victim.priority,
            "pushed_out",
            self.settings.wait_bound_s(victim.priority),
            f"overloaded: a {victim.priority}-priority request was pushed out of the full queue by a "
            f"{priority}-priority one",
        )
        if victim.task is not None:
            victim.task.cancel()

    def _refuse(self, refusal: Refused) -> None:
        self._on_refused(refusal)
        raise refusal


async def _stop(task: asyncio.Task[None]) -> bool:
    """Cancel a waiting ``acquire``; True when it had got its slot first (the caller holds it then).
    The caller's own cancellation, arriving while the ``acquire`` ends, is raised: taken for the
    ``acquire``'s, it was swallowed, and a request its caller, its session's newer version or an
    ``asyncio.timeout`` had cancelled ended as a 429 "waited". The ``acquire`` holds no slot then (a
    cancelled ``acquire`` hands on one granted in the same instant)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        caller = asyncio.current_task()
        if caller is not None and caller.cancelling():
            raise
        return False
    return True
