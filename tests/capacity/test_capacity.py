"""Capacity shifting: the controller's invariants (property tests), and the shell moving real replicas
between a real-time service and a batch pool through Redis."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from batch.config import BatchSettings
from batch.launch import batch_client_config, open_batch
from capacity.controller import CapacityController, CapacitySettings
from capacity.pool import PoolBoard, PoolFollower, SharedPool
from capacity.shifter import CapacityShifter
from devstack.stack import StackState
from llm_client.client import LLMClient
from realtime.config import RealtimeSettings
from realtime.service import SERVICE_KEY, create_app, realtime_client_config
from realtime.shifting import enable_capacity_shifting
from tests.conftest import Isolated


def _settings(**overrides: Any) -> CapacitySettings:
    options: dict[str, Any] = {
        "per_replica_rps": 10.0, "headroom": 0.25, "lead_s": 20.0, "trend_window_s": 20.0,
        "scale_down_after_s": 15.0, "step_interval_s": 5.0, "tick_s": 1.0,
    }  # fmt: skip
    options.update(overrides)
    return CapacitySettings(**options)


def _serves(s: CapacitySettings, rps: float, total: int) -> int:
    """Replicas the current load needs, with headroom (capped by what batch's floor leaves)."""
    return min(
        max(math.ceil(rps * (1 + s.headroom) / s.per_replica_rps - 1e-9), s.realtime_floor),
        total - s.batch_floor,
    )


@settings(max_examples=300, deadline=None)
@given(
    rates=st.lists(st.floats(0, 200, allow_nan=False), min_size=1, max_size=120),
    total=st.integers(2, 12),
    realtime_floor=st.integers(1, 3),
    batch_floor=st.integers(0, 2),
    headroom=st.floats(0, 1),
    lead=st.floats(0, 60),
    forecast=st.one_of(st.none(), st.floats(0, 300)),
)
def test_controller_never_starves_realtime_or_breaks_the_pool(
    rates: list[float],
    total: int,
    realtime_floor: int,
    batch_floor: int,
    headroom: float,
    lead: float,
    forecast: float | None,
) -> None:
    if realtime_floor + batch_floor > total:
        with pytest.raises(ValueError):
            CapacityController(_settings(realtime_floor=realtime_floor, batch_floor=batch_floor), total)
        return
    s = _settings(realtime_floor=realtime_floor, batch_floor=batch_floor, headroom=headroom, lead_s=lead)
    controller = CapacityController(s, total)
    last_down = -math.inf
    before = controller.realtime
    for t, rate in enumerate(rates):
        d = controller.decide(float(t), rate, forecast)
        assert d.realtime + d.batch == total
        assert realtime_floor <= d.realtime <= total - batch_floor
        assert d.batch >= batch_floor
        assert d.realtime >= _serves(s, rate, total), "never below what the current load needs"
        if d.realtime < before:
            assert before - d.realtime == 1 and t - last_down >= s.step_interval_s
            last_down = t
        before = d.realtime


def _day(t: float) -> float:
    """A compressed daily curve: night 10 req/s, a ramp from t=40 to a 90 req/s peak at t=80..100."""
    if t < 40:
        return 10.0
    if t < 80:
        return 10.0 + 80.0 * (t - 40) / 40
    if t < 100:
        return 90.0
    return max(10.0, 90.0 - 80.0 * (t - 100) / 20)


def test_scales_up_ahead_of_the_peak_and_gives_back_after_it() -> None:
    s = _settings()
    controller = CapacityController(s, 12)
    held = {}
    for t in range(0, 200):
        held[t] = controller.decide(float(t), _day(t)).realtime
    peak_need = _serves(s, 90.0, 12)
    first_full = min(t for t, n in held.items() if n >= peak_need)
    assert first_full < 80, f"held the peak's {peak_need} replicas only at t={first_full}"
    for t in range(40, 120):
        assert held[t] >= _serves(s, _day(t), 12)
    # After the peak (load falls from t=100): held for scale_down_after_s, then one replica per
    # step_interval_s, down to what the night needs.
    assert held[100 + int(s.scale_down_after_s) - 1] == max(held.values())
    downs = [t for t in range(121, 200) if held[t] < held[t - 1]]
    assert all(b - a >= s.step_interval_s for a, b in itertools.pairwise(downs))
    assert held[199] == _serves(s, 10.0, 12)


async def test_followers_move_real_replicas_between_the_two_sides(
    stack: StackState, isolated: Isolated, redis_client: Any
) -> None:
    """A shifter driven by a scripted rate; the batch pool and a real-time client follow the board."""
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    s = _settings(per_replica_rps=10.0, headroom=0.0, lead_s=0.0, scale_down_after_s=0.0, step_interval_s=0.0)
    board = PoolBoard(redis_client, isolated.prefix, pool)
    rates = iter([5.0, 25.0, 25.0, 5.0, 5.0, 100.0])
    now = [0.0]  # one clock for the shifter and both followers: the hand-off is stepped, not slept

    def clock() -> float:
        return now[0]

    shifter = CapacityShifter(CapacityController(s, 3), board, lambda _: next(rates), clock=clock)
    batch_settings = BatchSettings()
    llm = batch_client_config(stack.llm_endpoints, stack.model, batch_settings)
    realtime = realtime_client_config(stack.llm_endpoints, stack.model)
    async with open_batch(batch_settings, isolated.sinks(), llm) as runtime, LLMClient(realtime) as rt_client:
        batch_side = PoolFollower(board, "batch", runtime.pool.set_endpoints, handoff_s=0.3, clock=clock)
        rt_side = PoolFollower(board, "realtime", rt_client.set_endpoints, handoff_s=0.3, clock=clock)
        seen = []
        for _ in range(6):
            now[0] += 1.0
            decision = await shifter.tick()
            await batch_side.sync()
            await rt_side.sync()
            grew = rt_side.current is not None and len(rt_side.current) < decision.realtime
            if grew:
                # Newcomers drain batch calls first: batch dropped them at once, real-time waits.
                serving = {e.url for e in rt_client.endpoints} | {
                    e.url for e in runtime.pool.client.endpoints
                }
                assert serving < set(pool.replicas), "a handed-over replica serves neither side for a moment"
                now[0] += 0.35
                await rt_side.sync()
            rt_urls = [e.url for e in rt_client.endpoints]
            batch_urls = [e.url for e in runtime.pool.client.endpoints]
            assert len(rt_urls) == decision.realtime >= 1
            assert set(rt_urls).isdisjoint(batch_urls) and set(rt_urls) | set(batch_urls) == set(
                pool.replicas
            )
            assert runtime.pool.budget == batch_settings.per_replica_budget * max(len(batch_urls), 1)
            seen.append(decision.realtime)
        assert seen == [1, 3, 3, 2, 1, 3]
        assert runtime.pool.limit == 0, "batch holds no replica: its work waits instead of failing"


async def test_service_load_drives_the_split(stack: StackState, isolated: Isolated) -> None:
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    s = _settings(
        per_replica_rps=2.0, headroom=0.0, tick_s=0.2, trend_window_s=1.0, load_window_s=1.0, handoff_s=0.0
    )
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )
    enable_capacity_shifting(app, pool, s)
    async with TestClient(TestServer(app)) as client:
        service = app[SERVICE_KEY]
        assert len(service.llm.endpoints) == s.realtime_floor, "starts at the floor when idle"
        body = {"shopper_id": "s1", "candidates": ["a"], "deadline_ms": 50}
        started = time.monotonic()
        while time.monotonic() - started < 3.0 and len(service.llm.endpoints) < 3:
            await asyncio.gather(*(client.post("/v1/match", json=body) for _ in range(4)))
            await asyncio.sleep(0.05)
        assert len(service.llm.endpoints) == 3, "a busy real-time side took every replica"
        split = await PoolBoard(service.redis, service.key_prefix, pool).read()
        assert split is not None and split.realtime == 3
