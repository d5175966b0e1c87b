"""A cancel that comes as a wait ends is never lost (``runner.timers``; the same holds wherever the
project waits with a timeout: ``asyncio.wait_for`` is banned by the lint for this reason).

On Python 3.11 ``asyncio.wait_for`` returns the result when its task is cancelled after the awaited
thing completed, and drops the cancel. A loop stopped by cancelling it then runs on, and whoever
awaits it hangs: a batch job's checkpoint loop did, about once in thirty runs of the batch tests."""

from __future__ import annotations

import asyncio

import pytest

from runner.timers import TimerQueue


async def test_a_cancel_that_comes_as_a_timer_is_armed_stops_the_wait() -> None:
    timers = TimerQueue()
    waiting = asyncio.create_task(timers.wait(longest_s=30))
    for _ in range(3):  # the wait is parked on its wake-up
        await asyncio.sleep(0)
    timers.arm("s1", due_ts=1.0, deadline=0.0, version=(0, 0))  # wakes the wait...
    waiting.cancel()  # ...and the cancel comes in the same step
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)
