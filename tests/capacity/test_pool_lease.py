"""The published split is a lease: when the real-time shifter stops renewing it, batch takes the pool.

Without it, a real-time service that stopped or crashed while holding replicas left its split in Redis
for good, and with a batch floor of 0 batch held none until real time came back. Against the stack's
Redis (and, for the service, its replicas); every wait polls with generous bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from capacity.controller import CapacityController, CapacitySettings
from capacity.pool import PoolBoard, PoolFollower, Repoint, SharedPool
from capacity.shifter import CapacityShifter
from devstack.stack import StackState
from realtime.config import RealtimeSettings
from realtime.service import SERVICE_KEY, create_app, realtime_client_config
from realtime.shifting import enable_capacity_shifting
from tests.conftest import Isolated

TICK_S = 0.2
LEASE_S = 0.6
"""Three ticks: the shortest lease the settings allow at this tick."""


async def _eventually(check: Callable[[], Awaitable[bool]], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return await check()


def recorder(applied: list[list[str]]) -> Repoint:
    """A follower's ``apply`` that only records each side's replicas."""

    def apply(urls: list[str], *, withdraw_after_s: Mapping[str, float] | None = None) -> None:
        applied.append(urls)

    return apply


def _shifting_service(
    stack: StackState, isolated: Isolated, pool: SharedPool, settings: CapacitySettings
) -> web.Application:
    """The real-time service on the stack's replicas, shifting ``pool`` with ``settings``."""
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )
    enable_capacity_shifting(app, pool, settings)
    return app


def test_a_lease_must_outlast_a_few_ticks() -> None:
    with pytest.raises(ValidationError, match="three ticks"):
        CapacitySettings(tick_s=1.0, lease_s=2.5)
    assert CapacitySettings(tick_s=TICK_S, lease_s=LEASE_S).split_lease_s == LEASE_S


def test_the_default_lease_follows_a_long_tick_instead_of_refusing_it() -> None:
    """A tick that was valid before the lease existed stays valid: unset, the lease is three ticks."""
    assert CapacitySettings().split_lease_s == 10.0
    assert CapacitySettings(tick_s=5.0).split_lease_s == 15.0
    s = CapacitySettings(tick_s=5.0, scale_down_after_s=60.0)
    assert s.held_remembered_s == s.split_lease_s + 60.0


async def test_a_restart_after_the_lease_lapsed_resumes_from_the_count_real_time_held(
    stack: StackState, isolated: Isolated, redis_client: Any
) -> None:
    """At a peak, a real-time service down for longer than its lease comes back with the replicas it
    held, not its floor: the split lapsed (batch took the pool meanwhile), but its count is remembered."""
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    settings = CapacitySettings(tick_s=TICK_S, lease_s=LEASE_S, load_window_s=30, handoff_s=0.0)
    before = PoolBoard(
        redis_client,
        isolated.prefix,
        pool,
        lease_s=settings.split_lease_s,
        held_remembered_s=settings.held_remembered_s,
    )
    await before.publish(len(pool.replicas))  # the crashed service's last split: the whole pool

    async def lapsed() -> bool:
        return await before.read() is None

    assert await _eventually(lapsed, within_s=LEASE_S + 5.0)
    assert await before.remembered() == len(pool.replicas)
    app = _shifting_service(stack, isolated, pool, settings)
    async with TestClient(TestServer(app)):
        service = app[SERVICE_KEY]
        assert len(service.llm.endpoints) == len(pool.replicas), "restarted at the floor"
        split = await before.read()
        assert split is not None and split.realtime == len(pool.replicas)


async def test_what_real_time_held_is_forgotten_after_the_lease_and_the_scale_down_wait(
    isolated: Isolated, redis_client: Any
) -> None:
    pool = SharedPool(f"pool-{isolated.tag}", ["http://r0", "http://r1", "http://r2"])
    board = PoolBoard(redis_client, isolated.prefix, pool, lease_s=LEASE_S, held_remembered_s=2 * LEASE_S)
    await board.publish(2)
    held_ttl = await redis_client.pttl(board.held_key)
    assert LEASE_S * 1000 < held_ttl <= 2 * LEASE_S * 1000
    await asyncio.sleep(LEASE_S / 2)
    assert await board.renew()
    assert await redis_client.pttl(board.held_key) > held_ttl - 150, "renewed with the split"

    async def forgotten() -> bool:
        return await board.remembered() is None

    assert await board.remembered() == 2
    assert await _eventually(forgotten, within_s=2 * LEASE_S + 5.0)
    unleased = PoolBoard(redis_client, f"{isolated.prefix}fixed:", pool)  # bench's static split
    await unleased.publish(1)
    assert await unleased.remembered() is None, "a split without a lease is its own memory"


async def test_a_published_split_carries_a_lease_that_publishing_it_again_renews(
    isolated: Isolated, redis_client: Any
) -> None:
    pool = SharedPool(f"pool-{isolated.tag}", ["http://r0", "http://r1", "http://r2"])
    board = PoolBoard(redis_client, isolated.prefix, pool, lease_s=10.0)
    first = await board.publish(2, now=100.0)
    ttl = await redis_client.pttl(board.key)
    assert 8_000 < ttl <= 10_000, f"a split published with a 10 s lease has {ttl} ms left"
    await asyncio.sleep(0.3)
    before = await redis_client.pttl(board.key)
    again = await board.publish(2, now=101.0)
    after = await redis_client.pttl(board.key)
    assert after > before, f"publishing the unchanged split did not renew its lease ({before} -> {after} ms)"
    assert again == first == await board.read(), "a renewal changes nothing but the lease"

    await redis_client.delete(board.key)  # lapsed: publishing the same count is a first start again
    anew = await board.publish(2, now=102.0)
    assert anew.version == 1 and anew.join_times() == (None, None)
    assert 8_000 < await redis_client.pttl(board.key) <= 10_000

    fixed = PoolBoard(redis_client, f"{isolated.prefix}fixed:", pool)  # no lease: bench's static split
    await fixed.publish(1)
    assert await redis_client.pttl(fixed.key) == -1, "a split published without a lease never lapses"


async def test_once_the_shifter_stops_the_lease_lapses_and_batch_takes_the_whole_pool(
    isolated: Isolated, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capacity.pool")
    pool = SharedPool(f"pool-{isolated.tag}", ["http://r0", "http://r1", "http://r2"])
    settings = CapacitySettings(per_replica_rps=10.0, tick_s=TICK_S, lease_s=LEASE_S)
    board = PoolBoard(redis_client, isolated.prefix, pool, lease_s=settings.split_lease_s)
    # A peak: real time holds the whole pool, batch (floor 0) none.
    shifter = CapacityShifter(CapacityController(settings, 3), board, lambda _: 100.0)
    applied: dict[str, list[list[str]]] = {"batch": [], "realtime": []}
    followers = [
        PoolFollower(board, side, recorder(applied[side]), poll_s=0.05, handoff_s=0.0)
        for side in ("batch", "realtime")
    ]
    await shifter.tick()  # published before either side looks
    shifter.start()
    for follower in followers:
        follower.start()
    try:

        async def batch_holds_none() -> bool:
            return applied["batch"][-1:] == [[]] and applied["realtime"][-1:] == [list(pool.replicas)]

        assert await _eventually(batch_holds_none, within_s=5.0), applied
        await asyncio.sleep(4 * LEASE_S)  # the shifter's ticks keep the split in force
        assert applied["batch"] == [[]] and await board.read() is not None, applied

        await shifter.stop()

        async def batch_took_the_pool() -> bool:
            return applied["batch"][-1:] == [list(pool.replicas)]

        assert await _eventually(batch_took_the_pool, within_s=LEASE_S + 5.0), applied
        assert applied["realtime"] == [list(pool.replicas)], "real time keeps its last split"
    finally:
        await shifter.stop()
        for follower in followers:
            await follower.stop()
    lapsed = [r for r in caplog.records if "the split's lease lapsed" in r.getMessage()]
    assert len(lapsed) == 1 and lapsed[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]


async def test_the_service_keeps_its_split_while_it_runs_and_it_lapses_once_it_stops(
    stack: StackState, isolated: Isolated, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capacity.shifter")
    pool = SharedPool(f"pool-{isolated.tag}", stack.llm_endpoints)
    # The meter's window (the warm-up before the shifter decides) is longer than three leases.
    settings = CapacitySettings(tick_s=TICK_S, lease_s=LEASE_S, load_window_s=2, handoff_s=0.0)
    assert settings.load_window_s > 3 * settings.split_lease_s
    board = PoolBoard(redis_client, isolated.prefix, pool)
    app = _shifting_service(stack, isolated, pool, settings)
    async with TestClient(TestServer(app)):
        until = time.monotonic() + settings.load_window_s + 2 * settings.split_lease_s
        missing = 0
        while time.monotonic() < until:
            missing += await redis_client.pttl(board.key) < 0  # -2: gone; -1: published without a lease
            await asyncio.sleep(0.05)
        assert missing == 0, f"the split was missing or unleased at {missing} polls while the service ran"
        assert any(r.getMessage().startswith("capacity: ") for r in caplog.records), "the shifter took over"
        split = await board.read()
        assert split is not None and split.realtime == settings.realtime_floor

    async def lapsed() -> bool:
        return await board.read() is None

    assert await _eventually(lapsed, within_s=settings.split_lease_s + 5.0), "the split outlived the service"
    applied: list[list[str]] = []
    batch = PoolFollower(board, "batch", recorder(applied))
    assert await batch.sync() == list(pool.replicas) and applied == [list(pool.replicas)]
