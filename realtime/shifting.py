"""Capacity shifting wired into the real-time service: its measured request rate drives the split of the
shared replica pool, and its LLM client follows the split (``capacity`` holds the engine-free parts)."""

from __future__ import annotations

from aiohttp import web

from capacity.controller import CapacityController, CapacitySettings
from capacity.pool import PoolBoard, PoolFollower, SharedPool
from capacity.shifter import CapacityShifter
from realtime.service import SERVICE_KEY, LoadMeter


def enable_capacity_shifting(app: web.Application, pool: SharedPool, settings: CapacitySettings) -> None:
    """Run a shifter and a real-time follower with the service in ``app`` (``realtime.service``):
    the service's measured request rate drives the split, and its LLM client follows it."""
    service = app[SERVICE_KEY]
    service.load = LoadMeter(settings.load_window_s)
    board = PoolBoard(service.redis, service.key_prefix, pool)
    controller = CapacityController(settings, len(pool.replicas))
    shifter = CapacityShifter(controller, board, service.load.rate)
    follower = PoolFollower(board, "realtime", service.llm.set_endpoints, handoff_s=settings.handoff_s)

    async def start(app: web.Application) -> None:
        await shifter.tick()
        await follower.sync()
        shifter.start()
        follower.start()

    async def stop(app: web.Application) -> None:
        await shifter.stop()
        await follower.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
