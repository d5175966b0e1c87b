"""The sessions the runner keeps in memory stay bounded by ``session_cache_size`` (defects
4 and 5), and so does the shopper -> partition map kept beside them.

Before, eviction looked only at the oldest ``excess`` sessions and stopped there: busy ones among them
(in an epoch not yet durable, or with a pending trigger) kept the cache above its bound however many
idle sessions came after them; and the partition map kept an entry for every shopper ever seen.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from devstack.synthetic import SyntheticStream
from prompt_assembly.session import PendingTrigger
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.epochs import Epoch
from runner.session_store import SessionDelta
from tests.conftest import Isolated
from tests.helpers import produce_records

CACHE = 100
"""The smallest ``session_cache_size`` the settings allow."""


def runner_holding(shoppers: int) -> EmbeddedRunner:
    """A runner (never started) holding ``shoppers`` idle sessions, spread over four partitions."""
    runner = EmbeddedRunner(RunnerSettings(session_cache_size=CACHE), log=lambda _: None)
    for i in range(shoppers):
        sid = f"shopper-{i:04d}"
        runner.sessions.use(sid, i % 4, runner.processor.new_session)
    return runner


def test_eviction_skips_busy_sessions_and_brings_the_cache_to_its_bound() -> None:
    runner = runner_holding(250)
    sids = list(runner.sessions)
    in_flight = sids[:60]  # the oldest: their deltas are in an epoch whose prompts are still running
    epoch = Epoch(pending=1)
    epoch.deltas = [SessionDelta(sid, 0, runner.sessions[sid].take_changes(), None) for sid in in_flight]
    runner.epochs.append(epoch)
    waiting = sids[60:80]  # a pending trigger: their timers need them in memory
    for sid in waiting:
        runner.sessions[sid].pending = PendingTrigger("browse_pause", 1.0)

    runner.sessions.evict(runner.epochs.shoppers_in_flight())

    assert len(runner.sessions) == CACHE
    assert set(in_flight) | set(waiting) <= set(runner.sessions), "a busy session was evicted"
    kept_idle = [sid for sid in runner.sessions if sid not in set(in_flight) | set(waiting)]
    assert kept_idle == sids[-len(kept_idle) :], "the earliest loaded idle sessions go first"
    assert runner.sessions.partition_map.keys() == set(runner.sessions)


def test_busy_sessions_keep_the_cache_above_its_bound_only_when_all_are_busy() -> None:
    runner = runner_holding(130)
    sids = list(runner.sessions)
    for sid in sids[:110]:
        runner.sessions[sid].pending = PendingTrigger("browse_pause", 1.0)

    runner.sessions.evict(runner.epochs.shoppers_in_flight())

    assert list(runner.sessions) == sids[:110], "every idle one went; only busy ones stay above the bound"
    assert runner.sessions.partition_map.keys() == set(runner.sessions)


@pytest.mark.slow
def test_a_long_run_holds_at_most_the_cache_bound_of_sessions_and_partitions(isolated: Isolated) -> None:
    """Over three times more shoppers than the cache holds, pending triggers firing on the wall clock
    (so sessions go idle once their prompt is stored): once everything is durable, the runner holds
    at most ``session_cache_size`` sessions, and a partition for those only (it used to keep one for
    every shopper it had seen)."""
    records = SyntheticStream(shoppers=4 * CACHE, seed=23, zipf_s=0.2).take(1600)
    shoppers = {key.decode() for key, _, _ in records}
    assert len(shoppers) > 3 * CACHE
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    settings = isolated.runner(
        until_drained=False,
        session_cache_size=CACHE,
        timer_wall_per_event_s=0.005,  # a 20 s browse pause fires after 0.1 s
        batch_max_events=100,
    )
    runner = EmbeddedRunner(settings, log=lambda _: None)

    async def run_until_settled() -> tuple[int, int, set[str]]:
        task = asyncio.create_task(runner.run())
        acct = runner.stats.accounting
        try:
            deadline = time.monotonic() + 180
            # Settled: everything consumed, every trigger fired, every result stored, and the durable
            # point that took the last epochs (and evicted after saving them) has finished.
            while not (
                acct.consumed == len(records)
                and runner.in_flight == 0
                and len(runner.timers) == 0
                and len(runner.epochs) == 0
                and not runner.commits.busy
            ):
                assert not task.done(), "the runner ended early"
                assert time.monotonic() < deadline, f"not settled: {acct}, {runner.in_flight} in flight"
                await asyncio.sleep(0.05)
            return (
                len(runner.sessions),
                len(runner.sessions.partition_map),
                set(runner.sessions.partition_map),
            )
        finally:
            runner.request_stop()
            await task

    sessions, partitions, mapped = asyncio.run(run_until_settled())
    assert runner.stats.accounting.balanced
    assert sessions <= CACHE, f"{sessions} sessions held, bound {CACHE}"
    assert partitions <= CACHE, f"the partition map holds {partitions} shoppers, bound {CACHE}"
    assert mapped <= shoppers


def test_a_session_its_epoch_touched_is_kept_over_older_ones() -> None:
    """An epoch's ``close_epoch`` (a poll's, or a fired trigger's) counts as a use of every session it
    touched: the one lookup the poll makes (``SessionCache.lookup``) does not. The oldest session,
    touched by an epoch that is now durable, outlives the idle sessions loaded after it."""
    runner = runner_holding(CACHE + 1)
    sids = list(runner.sessions)
    oldest = sids[0]
    runner.close_epoch(Epoch(lease=runner.assignment.lease), {oldest})
    durable = runner.epochs.take_completed_prefix()  # what the durable point takes, then saves
    assert len(durable) == 1 and not runner.epochs

    assert runner.sessions.evict(runner.epochs.shoppers_in_flight()) == 1

    assert oldest in runner.sessions, "the session its epoch just used was evicted as the least recent"
    assert sids[1] not in runner.sessions, "the least recently used idle session goes"
    assert list(runner.sessions)[-1] == oldest
