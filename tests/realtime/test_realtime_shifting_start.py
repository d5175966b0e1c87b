"""Capacity shifting across a restart of the real-time service: the split in force stays in force.

The first tick on start used to decide on an empty load meter (rate 0) and publish the floor, dropping
the split in force on every restart; then the meter, divided by its whole window while it had covered
less, read a steady load as a ramp from 0, which the controller extrapolated ``lead_s`` ahead and took
the whole pool from batch. Against the stack's Redis and replicas, with a steady load over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from capacity.controller import CapacitySettings
from capacity.pool import PoolBoard, SharedPool
from devstack.stack import StackState
from prompt_assembly.errors import ConfigurationError
from realtime.config import RealtimeSettings
from realtime.load_meter import LoadMeter
from realtime.service import SERVICE_KEY, create_app, realtime_client_config
from realtime.shifting import enable_capacity_shifting
from tests.conftest import Isolated

RATE_RPS = 30.0
"""The steady load: two replicas' worth at ``per_replica_rps`` 25, with room either side for noise."""


def test_a_steady_load_reads_steady_from_the_meters_first_second() -> None:
    meter = LoadMeter(2)
    start = 1_000.4  # not on a whole second: the meter's seconds count from its start
    meter.begin(start)
    for i in range(int(5 * RATE_RPS)):
        meter.hit(start + i / RATE_RPS)
    assert meter.rate(start + 0.9) == 0.0, "no second measured yet"
    assert not meter.covered(start + 1.99) and meter.covered(start + 2.0)
    assert [meter.rate(start + s) for s in (1, 2, 3, 4, 5)] == [RATE_RPS] * 5


@pytest.mark.parametrize("window_s", [0, 0.5, 2.5])
def test_a_load_window_is_whole_seconds(window_s: float) -> None:
    # 0.5 summed no second and read 0 always; 2.5 summed 2 seconds and divided by 2.5 (20% low).
    with pytest.raises(ConfigurationError, match="whole"):
        LoadMeter(window_s)


async def test_a_restart_keeps_the_split_and_a_steady_load_moves_nothing(
    stack: StackState, isolated: Isolated, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capacity.shifter")
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    assert len(pool.replicas) == 3
    board = PoolBoard(redis_client, isolated.prefix, pool)
    await board.publish(2, time.time() - 600)  # what the previous run of the service left in force
    settings = CapacitySettings(
        per_replica_rps=25.0, headroom=0.0, lead_s=4.0, trend_window_s=3.0, tick_s=0.25,
        load_window_s=2, handoff_s=0.0,
    )  # fmt: skip
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )
    enable_capacity_shifting(app, pool, settings)
    sent: set[asyncio.Task[Any]] = set()
    async with TestClient(TestServer(app)) as client:
        service = app[SERVICE_KEY]

        async def steady_load() -> None:
            body = {"shopper_id": "s1", "candidates": ["a"], "deadline_ms": 200}
            while True:  # paced, never catching up: a stall makes the load lower, not burstier
                task = asyncio.create_task(client.post("/v1/match", json=body))
                sent.add(task)
                task.add_done_callback(sent.discard)
                await asyncio.sleep(1 / RATE_RPS)

        load = asyncio.create_task(steady_load())
        seen: list[tuple[int, int]] = []
        try:
            # The meter's window, then a trend window and more of decisions.
            until = time.monotonic() + settings.load_window_s + settings.trend_window_s + 1.5
            while time.monotonic() < until:
                split = await board.read()
                assert split is not None
                seen.append((split.realtime, len(service.llm.endpoints)))
                await asyncio.sleep(0.1)
        finally:
            load.cancel()
            await asyncio.gather(load, *sent, return_exceptions=True)
    decisions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capacity: ")]
    assert decisions, "the shifter decided once the meter had covered its window"
    assert set(seen) == {(2, 2)}, f"the split in force moved: {sorted(set(seen))}; {decisions}"


async def test_the_shifting_loops_stop_before_the_service_closes_its_clients(
    stack: StackState, isolated: Isolated
) -> None:
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )
    enable_capacity_shifting(app, pool, CapacitySettings(tick_s=0.05, load_window_s=1))
    loops = ("capacity-warm-up", "capacity-shifter", "pool-follower-realtime")
    running_at_cleanup: list[str] = []

    async def first_cleanup(app: Any) -> None:  # runs before the service closes Redis and the LLM client
        running_at_cleanup.extend(t.get_name() for t in asyncio.all_tasks() if t.get_name() in loops)

    app.on_cleanup.insert(0, first_cleanup)
    async with TestClient(TestServer(app)):
        await asyncio.sleep(1.5)  # the meter covers its window: the shifter runs beside the follower
        running = {t.get_name() for t in asyncio.all_tasks()}
        assert {"capacity-shifter", "pool-follower-realtime"} <= running
    assert running_at_cleanup == [], (
        f"still running while the service closed its clients: {running_at_cleanup}"
    )
