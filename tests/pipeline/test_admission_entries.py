"""The admission gate keeps no entry for a waiter that was cancelled (no I/O, no clock)."""

from __future__ import annotations

import asyncio
import contextlib

from pipeline.admission import BACKFILL_CLASS, URGENT_CLASS, AdmissionGate


async def settle() -> None:
    """Let every task that can run, run (a few loop turns; no wall-clock waiting)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_cancelled_waiters_behind_a_starved_one_leave_no_entries() -> None:
    """A sustained overload with a backfill: the oldest backfilled prompt is starved (a fresh prompt
    always waits ahead of it), and behind it each shopper's backfilled prompt is displaced by the next.
    Only the two ends of a queue were trimmed, so every displaced prompt's entry stayed behind the
    starved one, for as long as the overload lasted."""
    gate = AdmissionGate(lambda: 1, by_priority=True, lifo_after_s=1.0)
    await gate.acquire((-1, -1))  # the one slot, held: the fleet is busy
    fresh = asyncio.create_task(gate.acquire((URGENT_CLASS, 0)))
    starved = asyncio.create_task(gate.acquire(gate.backfill_rank()))
    tail = asyncio.create_task(gate.acquire(gate.backfill_rank()))
    for _ in range(200):
        newer = asyncio.create_task(gate.acquire(gate.backfill_rank()))
        await settle()
        tail.cancel()  # that shopper's next prompt displaced its backfilled one
        tail = newer
        await settle()
    assert (gate.waiting, gate.waiting_in(BACKFILL_CLASS)) == (3, 2)
    assert len(gate._classes[BACKFILL_CLASS]) == 2, "an entry for each live waiter, none for the cancelled"
    for task in (fresh, starved, tail):
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(fresh, starved, tail)
    assert gate.waiting == 0 and not any(gate._classes.values())
