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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.config import GatewaySettings, Priority
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
class _Waiter:
    priority: Priority
    klass: int
    arrival: int
    task: asyncio.Task[None]
    """Its ``AdmissionGate.acquire``."""
    owner: asyncio.Task[object] | None
    """The task waiting (the flight's): cancelled when the request is superseded."""
    refusal: Refused | None = None

    @property
    def live(self) -> bool:
        """Still waiting: not granted, not refused, not being stopped (a cancellation is handled
        on the owner's next step, so the gate's own count still includes it for a moment)."""
        return (
            self.refusal is None
            and not self.task.done()
            and (self.owner is None or not self.owner.cancelling())
        )


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
        self._waiters: set[_Waiter] = set()
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
        if self.mean_hold_s is None:
            return None
        klass = PRIORITY_CLASS[priority]
        ahead = sum(1 for w in self._waiters if w.klass <= klass and w.live)
        return (ahead + 1) / self.limit * self.mean_hold_s

    @contextlib.asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        """Hold a slot for the block, or raise ``Refused``. Cancelled while waiting, holds nothing."""
        await self._acquire(priority)
        started = time.monotonic()
        try:
            yield
        finally:
            self.gate.release()
            held = time.monotonic() - started
            previous = self.mean_hold_s
            self.mean_hold_s = held if previous is None else previous + HOLD_SMOOTHING * (held - previous)

    async def _acquire(self, priority: Priority) -> None:
        klass = PRIORITY_CLASS[priority]
        rank = (klass, next(self._arrivals))
        gate = self.gate
        if gate.active < gate.limit and not gate.waiting:
            await gate.acquire(rank)  # returns at once
            return
        bound = self.settings.wait_bound_s(priority)
        predicted = self.predicted_wait_s(priority)
        if predicted is not None and predicted > bound:
            self._refuse(
                Refused(
                    priority,
                    "predicted_wait",
                    predicted,
                    f"overloaded: a {priority}-priority request would wait about {predicted:.1f} s "
                    f"for a replica slot, over its {bound:g} s bound",
                )
            )
        if sum(w.live for w in self._waiters) >= self.max_waiting:
            self._push_out_below(klass, predicted)
        owner = asyncio.current_task()
        waiter = _Waiter(priority, klass, rank[1], asyncio.create_task(gate.acquire(rank)), owner)
        self._waiters.add(waiter)
        try:
            done, _ = await asyncio.wait({waiter.task}, timeout=bound)
        except asyncio.CancelledError:  # superseded, or the gateway is stopping
            if await _stop(waiter.task):
                gate.release()  # granted in the same instant: hand the slot on
            raise
        finally:
            self._waiters.discard(waiter)
        if not done and await _stop(waiter.task):
            return  # granted just as the bound passed: take it
        if not waiter.task.cancelled():
            return
        self._refuse(
            waiter.refusal
            or Refused(
                priority,
                "waited",
                self.predicted_wait_s(priority) or bound,
                f"overloaded: a {priority}-priority request waited {bound:g} s for a replica slot",
            )
        )

    def _push_out_below(self, klass: int, predicted: float | None) -> None:
        """Make room in a full queue by refusing the newest waiter of the lowest class below ``klass``;
        refuse the arrival itself when there is none."""
        lower = [w for w in self._waiters if w.klass > klass and w.refusal is None and not w.task.done()]
        priority = next(p for p, k in PRIORITY_CLASS.items() if k == klass)
        if not lower:
            retry = predicted if predicted is not None else self.settings.wait_bound_s(priority)
            self._refuse(
                Refused(
                    priority,
                    "queue_full",
                    retry,
                    f"overloaded: {self.max_waiting} requests of {priority} priority or higher wait for "
                    f"a replica slot (at most {self.max_waiting})",
                )
            )
        victim = max(lower, key=lambda w: (w.klass, w.arrival))
        victim.refusal = Refused(
            victim.priority,
            "pushed_out",
            self.settings.wait_bound_s(victim.priority),
            f"overloaded: a {victim.priority}-priority request was pushed out of the full queue by a "
            f"{priority}-priority one",
        )
        victim.task.cancel()

    def _refuse(self, refusal: Refused) -> None:
        self._on_refused(refusal)
        raise refusal


async def _stop(task: asyncio.Task[None]) -> bool:
    """Cancel a waiting ``acquire``; True when it had got its slot first (the caller holds it then)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return False
    return True
