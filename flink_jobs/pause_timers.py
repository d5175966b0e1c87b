"""When the session function's processing-time timer for a pending trigger goes off, and what it fires.

Why a relative deadline: a trigger's ``due_ts`` is in *event* time. Arming the timer at ``due_ts`` read
as wall-clock time (what the job did) fires at once for every event of a replayed backlog older than the
quiet period, so where a timer ran before the shopper's next event was read, each event became a prompt;
and arming it at ``due_ts`` truncated to the millisecond made ``fire_pending`` answer "not yet" for
almost every real ``time.time()`` value, so a live browse pause never fired. The embedded runner waits
``due_ts - last_event_ts`` on the wall clock from when it saw the shopper's last event
(``runner/embedded.py``, ``_wall_deadline``); the job does the same here, so the engines agree on both
live and replayed streams.

One timer per shopper: the deadline and the due time it was armed for are kept in keyed state
(``ArmedTimer``), an earlier timer is deleted when the trigger moves, and the timer fires exactly the
due time it was armed for, so no rounding of event time into timer milliseconds can make it miss.
Like the runner, a trigger whose due time did not move keeps its earlier deadline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArmedTimer:
    """The processing-time timer armed for a shopper's pending trigger, as kept in keyed state."""

    fires_at_ms: int
    due_ts: float
    """The pending trigger's due time (event time) the timer was armed for."""

    def to_state(self) -> str:
        return f"{self.fires_at_ms} {self.due_ts!r}"  # repr: the float round-trips exactly

    @classmethod
    def from_state(cls, raw: str) -> ArmedTimer:
        fires_at_ms, due_ts = raw.split(" ")
        return cls(int(fires_at_ms), float(due_ts))


def wall_deadline_ms(now_ms: int, due_ts: float, last_event_ts: float, lateness_ms: int = 0) -> int:
    """The processing time at which a trigger due at event time ``due_ts`` fires, for a shopper whose
    newest event (``last_event_ts``) was processed at ``now_ms``: the event-time wait from that event to
    the due time, on the wall clock, rounded up to the next millisecond (never early), plus
    ``lateness_ms``. A due time already past (a rate-limited cart add replayed late) fires at once."""
    wait_ms = math.ceil(max(0.0, due_ts - last_event_ts) * 1000)
    return now_ms + wait_ms + lateness_ms


@dataclass(frozen=True, slots=True)
class Rearm:
    """What to do with the timer service when a shopper's pending trigger is (re)decided."""

    armed: ArmedTimer
    delete_ms: int | None
    """The timer to delete (the one armed before), if any."""
    register_ms: int | None
    """The timer to register, if any (None: the one armed before stays)."""


def rearm(before: ArmedTimer | None, due_ts: float, deadline_ms: int) -> Rearm:
    """The timer for a trigger due at ``due_ts`` with a new wall deadline ``deadline_ms``, given the one
    armed before: kept when it is for the same due time and fires no later (the runner fires a trigger
    at the earliest deadline armed for its due time), else replaced."""
    if before is not None and before.due_ts == due_ts and before.fires_at_ms <= deadline_ms:
        return Rearm(before, None, None)
    delete = None if before is None or before.fires_at_ms == deadline_ms else before.fires_at_ms
    return Rearm(ArmedTimer(deadline_ms, due_ts), delete, deadline_ms)


def due_to_fire(armed: ArmedTimer | None, timestamp_ms: int, lateness_ms: int) -> float | None:
    """The due time to pass to ``SessionProcessor.fire_pending`` when a processing-time timer fires at
    ``timestamp_ms``; None when the timer is not the shopper's current one (nothing to fire).

    A timer with no ``ArmedTimer`` in state was armed by a job version before this module, at
    ``int(due_ts * 1000) + lateness_ms`` (restored from a savepoint): it fires the trigger due within
    the millisecond it was truncated to, which is what that version meant."""
    if armed is None:
        return (timestamp_ms - lateness_ms + 1) / 1000
    if armed.fires_at_ms != timestamp_ms:
        return None
    return armed.due_ts
