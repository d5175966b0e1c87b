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

Why a restored timer waits (``restored_deadline_ms``): a restore from a checkpoint or savepoint brings
back timers whose wall deadlines passed while the job was down, and Flink fires them at once, before the
replay from the checkpoint's offsets has brought the shopper's newer events. Such a timer fired a prompt
for a session as it stood at the checkpoint, which the run without the failure never made: a newer
event had moved its trigger (a TaskManager killed at 1x made 1.5-1.9% more calls than a clean run, none
of them a repeat). A timer armed before this run of the job started therefore fires no earlier than its
own wait after the start: the replayed events get the quiet period the live ones had, and the timer is
moved by them as it would have been. The embedded runner does not do this: it commits sessions and
offsets together once a second and restarts in seconds, so what it replays is seconds long, not a
checkpoint interval and a TaskManager's replacement.
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
    armed_at_ms: int | None = None
    """The processing time it was armed at; None in state written before this was kept."""

    def to_state(self) -> str:
        text = f"{self.fires_at_ms} {self.due_ts!r}"  # repr: the float round-trips exactly
        return text if self.armed_at_ms is None else f"{text} {self.armed_at_ms}"

    @classmethod
    def from_state(cls, raw: str) -> ArmedTimer:
        fires_at_ms, due_ts, *armed_at_ms = raw.split(" ")
        return cls(int(fires_at_ms), float(due_ts), int(armed_at_ms[0]) if armed_at_ms else None)


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


def rearm(before: ArmedTimer | None, due_ts: float, deadline_ms: int, now_ms: int | None = None) -> Rearm:
    """The timer for a trigger due at ``due_ts`` with a new wall deadline ``deadline_ms``, armed at
    ``now_ms``, given the one armed before: kept when it is for the same due time and fires no later
    (the runner fires a trigger at the earliest deadline armed for its due time), else replaced."""
    if before is not None and before.due_ts == due_ts and before.fires_at_ms <= deadline_ms:
        return Rearm(before, None, None)
    delete = None if before is None or before.fires_at_ms == deadline_ms else before.fires_at_ms
    return Rearm(ArmedTimer(deadline_ms, due_ts, now_ms), delete, deadline_ms)


def restored_deadline_ms(armed: ArmedTimer, now_ms: int, started_ms: int, wait_ms: int) -> int | None:
    """When a timer going off at ``now_ms`` should fire instead, if it was armed before this run of the
    job started at ``started_ms`` (restored from a checkpoint or savepoint): ``wait_ms`` after the
    start (the caller passes the wait from the shopper's newest event to the due time: what the timer
    was armed with, or less when a later event kept it; see the module docstring). None: fire now,
    because it was armed in this run, or its wait after the start is over."""
    if armed.armed_at_ms is not None and armed.armed_at_ms >= started_ms:
        return None
    deadline = started_ms + wait_ms
    return deadline if deadline > now_ms else None


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
