"""``capacity.background.BackgroundLoop.stop`` against a cancel that does not take the first time."""

from __future__ import annotations

import asyncio

from capacity.background import BackgroundLoop
from sinks.config import SinkSettings
from tests.conftest import Isolated


async def test_a_loop_that_swallows_a_cancel_is_stopped_all_the_same() -> None:
    swallowed = 0

    async def body() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as a library mid-call may: the task goes on as if never cancelled

    loop = BackgroundLoop("swallows-once", body)
    loop.start()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(loop.stop(), 5)
    assert swallowed == 1 and not loop.running


async def test_a_loop_writing_to_redis_is_stopped_every_time(isolated: Isolated) -> None:
    # redis-py's asyncio client with a socket timeout (SinkSettings' default) swallows about one cancel
    # in four that lands in a command: a real-time service's capacity warm-up loop, renewing its lease,
    # kept running after its stop, and the service's shutdown waited for good.
    settings: SinkSettings = isolated.sinks()
    assert settings.redis_timeout_s is not None, "the default the swallow needs"
    redis = settings.redis_client()
    key = f"{isolated.prefix}background"

    async def body() -> None:
        while True:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set(key, b"1", px=1000)
                pipe.pexpire(key, 1000)
                await pipe.execute()
            await asyncio.sleep(0)

    try:
        for attempt in range(40):
            loop = BackgroundLoop(f"redis-{attempt}", body)
            loop.start()
            await asyncio.sleep(0.0005 * (attempt % 10))
            await asyncio.wait_for(loop.stop(), 5)
            assert not loop.running
    finally:
        await redis.aclose()
