"""The hand-over on a steep ramp: each newcomer joins real-time a whole ``handoff_s`` after batch
dropped it, even when the next split is published before that hand-off ends."""

from __future__ import annotations

from typing import Any

from capacity.pool import PoolBoard, SharedPool
from devstack.stack import StackState
from tests.conftest import Isolated


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
