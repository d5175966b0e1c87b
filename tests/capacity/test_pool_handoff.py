"""The hand-over: each newcomer joins real-time a whole ``handoff_s`` after batch dropped it, even when
the next split is published before that hand-off ends (a steep ramp), and batch's calls still on it
then are moved to a replica batch kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from capacity.pool import ABORT_NOTICE_S, PoolBoard, PoolFollower, SharedPool
from devstack.stack import StackState
from llm_client import LLMClient
from serving.simulator.testing import running_simulator
from tests.conftest import Isolated
from tests.helpers import until
from tests.llm_client.slow_calls import SLOW, aborted, calls_spread_over, config, held


async def test_a_newer_split_does_not_cut_a_running_handoff_short(
    stack: StackState, isolated: Isolated, redis_client: Any
) -> None:
    pool = SharedPool(f"pool-{isolated.tag}", [f"http://r{i}" for i in range(6)])
    board = PoolBoard(redis_client, isolated.prefix, pool)
    for step, realtime in enumerate([2, 3, 4]):  # one tick_s (1 s) apart, shorter than handoff_s (2 s)
        await board.publish(realtime, now=100.0 + step)
    split = await board.read()
    assert split is not None
    # r2 left batch at 101, r3 at 102: at 102.1 neither has had its 2 s.
    assert split.urls("realtime", 102.1, 2.0) == ["http://r0", "http://r1"]
    assert split.urls("realtime", 103.0, 2.0) == ["http://r0", "http://r1", "http://r2"]
    assert split.urls("realtime", 104.0, 2.0) == ["http://r0", "http://r1", "http://r2", "http://r3"]
    assert split.urls("batch", 102.1, 2.0) == ["http://r4", "http://r5"]


async def test_batch_calls_still_on_a_handed_over_replica_are_moved_off_before_real_time_takes_it(
    isolated: Isolated, redis_client: Any
) -> None:
    """Batch holds both replicas, with slow calls on each; real time takes r0. Batch's calls there run
    on until a disconnect poll before the hand-off's end, then are cut (r0 aborts them by the time real
    time takes it) and answered by r1."""
    handoff_s = 2.0
    async with (
        running_simulator(time_scale=SLOW) as r0,
        running_simulator(time_scale=SLOW) as r1,
        LLMClient(config([r0.url, r1.url])) as batch,
        LLMClient(config([r0.url, r1.url])) as real_time,
    ):
        pool = SharedPool(f"pool-{isolated.tag}", [r0.url, r1.url])
        board = PoolBoard(redis_client, isolated.prefix, pool, handoff_s=handoff_s)
        batch_side = PoolFollower(board, "batch", batch.set_endpoints)
        rt_side = PoolFollower(board, "realtime", real_time.set_endpoints)
        await board.publish(0)  # batch holds the pool
        assert await batch_side.sync() == [r0.url, r1.url]
        calls, on_r0 = await calls_spread_over(batch, r0.url)

        moved = await board.publish(1)
        await batch_side.sync()
        assert [e.url for e in batch.fleet.endpoints] == [r1.url]
        await asyncio.sleep((handoff_s - ABORT_NOTICE_S) * 0.8)
        assert await held(r0.url) == on_r0, "cut early: no need to redo them yet"
        while not await rt_side.sync():
            await asyncio.sleep(0.02)
        assert time.time() >= moved.changed_at + handoff_s

        async def free() -> bool:
            return await held(r0.url) == 0

        await until(free, 0.2)  # noticed at the replica's disconnect poll, by the join
        assert await aborted(r0.url) == on_r0
        answers = await asyncio.gather(*calls)
    assert {a.endpoint for a in answers} == {batch.fleet.endpoints[0].name}
    assert batch.withdrawn == on_r0 and batch.retries == 0


async def test_batch_follows_the_shifters_hand_off_and_gives_each_lost_replica_its_own(
    isolated: Isolated, redis_client: Any
) -> None:
    """Batch's own hand-off setting differs from the shifter's, and it learns of two moves late, in one
    poll: each replica's calls may run until real time takes that replica, as the split says."""
    pool = SharedPool(f"pool-{isolated.tag}", [f"http://r{i}" for i in range(4)])
    board = PoolBoard(redis_client, isolated.prefix, pool, handoff_s=2.0)
    now = [100.0]
    applied: list[tuple[list[str], Mapping[str, float] | None]] = []

    def apply(urls: list[str], *, withdraw_after_s: Mapping[str, float] | None = None) -> None:
        applied.append((urls, withdraw_after_s))

    batch_side = PoolFollower(board, "batch", apply, handoff_s=30.0, clock=lambda: now[0])
    await board.publish(1, now=100.0)
    await batch_side.sync()
    await board.publish(2, now=101.0)  # r1 moves
    await board.publish(3, now=102.5)  # r2 moves
    now[0] = 103.0  # batch polls late
    await batch_side.sync()
    # r1 joins real time at 103.0, r2 at 104.5; each is cut a second (ABORT_NOTICE_S) before.
    assert applied[-1] == (["http://r3"], {"http://r1": 0.0, "http://r2": 0.5})
    rt_side = PoolFollower(board, "realtime", apply, handoff_s=30.0, clock=lambda: now[0])
    assert await rt_side.sync() == ["http://r0", "http://r1"]

    await board.publish(4, now=103.0)  # a peak takes the last one: batch's calls have nowhere to go
    await batch_side.sync()
    assert applied[-1] == ([], {}), "cut with no replica kept, they would fail at their deadline"
