"""A cancel that comes as a wait ends is never lost (``runner.timers``; the same holds wherever the
project waits with a timeout: ``asyncio.wait_for`` is banned by the lint for this reason).

On Python 3.11 ``asyncio.wait_for`` returns the result when its task is cancelled after the awaited
thing completed, and drops the cancel. A loop stopped by cancelling it then runs on, and whoever
awaits it hangs: a batch job's checkpoint loop did, about once in thirty runs of the batch tests.

And a stale entry (armed for a pending trigger that has fired since) fires nothing when it pops, even
where the session's new pending trigger has the same due time."""

from __future__ import annotations

import asyncio
import time

import pytest

from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy
from runner.embedded import EmbeddedRunner
from runner.timers import TimerQueue
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, wait_until
from tests.helpers import produce_records
from tests.runner.kit import run_showing_logs, running, view


async def test_a_cancel_that_comes_as_a_timer_is_armed_stops_the_wait() -> None:
    timers = TimerQueue()
    waiting = asyncio.create_task(timers.wait(longest_s=30))
    for _ in range(3):  # the wait is parked on its wake-up
        await asyncio.sleep(0)
    timers.arm("s1", due_ts=1.0, deadline=0.0, version=(0, 0))  # wakes the wait...
    waiting.cancel()  # ...and the cancel comes in the same step
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)


@pytest.mark.slow
def test_an_entry_armed_before_a_pause_fired_does_not_fire_the_next_pause_with_its_due_time(
    isolated: Isolated,
) -> None:
    """A view at t arms the browse pause (due t+20); a late view (t-3), in a poll of its own, arms a
    second entry for the same pause and prompt version. The first entry fires the pause. A late view
    (t-5) after the fire makes a new pause with the same due time (the newest event has not moved),
    armed a whole quiet period from then. The second entry, armed before the fire, pops before that:
    it must launch nothing (it fired the new pause at once, without its quiet period, when the loop
    passed only the due time to ``fire_armed`` and not the version the entry was armed under).

    The real runner on the test's broker, Redis and simulator; only the timers' wall clock is the
    test's own (``TimerQueue``'s ``clock``), so each entry pops on cue. Without a rate limit: under one
    (the default 10 s, counted from when the pause became due since ea69537) the new pause is due 10 s
    later, so no stale entry shares its due time (``tests/prompt_assembly/test_sessions.py`` has both)."""
    clock = [1000.0]
    log = RunnerLog()
    no_rate_limit = SessionConfig(triggers=TriggerPolicy(min_prompt_interval_s=0))
    settings = isolated.runner(until_drained=False, timer_wall_per_event_s=1.0, session=no_rate_limit)
    runner = EmbeddedRunner(settings, log=log)
    runner.timers = TimerQueue(clock=lambda: clock[0])  # a fake wall: 1 s per event second, 20 s quiet
    sid = "shopper-late"
    t = time.time() - 300

    async def scenario() -> None:
        acct = runner.stats.accounting

        async def send(ts: float, consumed: int, armed: int) -> None:
            await asyncio.to_thread(
                produce_records,
                isolated.stack.kafka_bootstrap,
                isolated.topic,
                [(sid.encode(), view(sid, ts), False)],
            )
            await wait_until(lambda: acct.consumed == consumed and len(runner.timers) == armed, f"view {ts}")

        async with running(runner) as (task,):
            await send(t, consumed=1, armed=1)  # entry A: deadline 1020
            clock[0] = 1005.0
            await send(t - 3, consumed=2, armed=2)  # entry B: deadline 1025, same pause and version
            clock[0] = 1020.0
            await wait_until(lambda: acct.prompts == 1 and len(runner.timers) == 1, "entry A fires the pause")
            await send(t - 5, consumed=3, armed=2)  # entry C: deadline 1040, the new pause
            session = runner.sessions[sid]
            assert session.pending is not None and session.pending.due_ts == t + 20
            clock[0] = 1025.0
            await wait_until(lambda: len(runner.timers) == 1, "entry B pops")  # it launches as it pops
            assert acct.prompts == 1, "the stale entry fired the new pause before its quiet period"
            clock[0] = 1040.0
            await wait_until(lambda: acct.prompts == 2 and acct.insights == 2, "entry C fires the new pause")
            assert not task.done(), log.render()

    run_showing_logs(scenario(), runner=log)
