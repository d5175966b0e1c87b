"""Capacity shifting wired into the real-time service: its measured request rate drives the split of the
shared replica pool, and its LLM client follows the split (``capacity`` holds the engine-free parts).

On start the split in force stays in force: the controller resumes from the published count, and decides
only once the service's load meter has covered its window. Deciding on the empty meter of a fresh start
(rate 0) published the floor on every restart, and the meter filling up looked like a ramp that the
controller extrapolated ``lead_s`` ahead, taking the whole pool from batch for minutes. Until the shifter
starts, the warm-up renews the split's lease every ``tick_s``, so a lease shorter than the meter's
window does not lapse meanwhile. Stopping the service renews it no more: the split lapses after
its lease and batch takes the pool, unless the service is back first. A service back later, while the
count it held is still remembered (``CapacitySettings.held_remembered_s``), resumes from that count:
at a peak it would otherwise restart from the floor."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from capacity.background import BackgroundLoop
from capacity.controller import CapacityController, CapacitySettings
from capacity.pool import PoolBoard, PoolFollower, SharedPool
from capacity.shifter import CapacityShifter
from realtime.service import SERVICE_KEY, LoadMeter

log = logging.getLogger(__name__)


def enable_capacity_shifting(app: web.Application, pool: SharedPool, settings: CapacitySettings) -> None:
    """Run a shifter and a real-time follower with the service in ``app`` (``realtime.service``):
    the service's measured request rate drives the split, and its LLM client follows it."""
    service = app[SERVICE_KEY]
    service.load = LoadMeter(settings.load_window_s)
    board = PoolBoard(
        service.redis,
        service.key_prefix,
        pool,
        lease_s=settings.split_lease_s,
        held_remembered_s=settings.held_remembered_s,
        handoff_s=settings.handoff_s,
    )
    controller = CapacityController(settings, len(pool.replicas))
    shifter = CapacityShifter(controller, board, service.load.rate)
    follower = PoolFollower(board, "realtime", service.llm.set_endpoints, handoff_s=settings.handoff_s)

    async def renew_lease() -> None:  # of the resumed split, published anew if it vanished meanwhile
        await board.publish(controller.realtime)

    warm_up = BackgroundLoop(
        "capacity-warm-up", lambda: _start_once_covered(service.load, shifter, renew_lease, settings.tick_s)
    )

    async def start(app: web.Application) -> None:
        now = time.time()
        service.load.begin(now)
        split = await board.read()
        held = split.realtime if split is not None else await board.remembered()
        controller.realtime = _resumed(held, controller)
        await board.publish(controller.realtime, now)  # a first start's floor; else nothing changes
        await follower.sync()
        follower.start()
        warm_up.start()

    async def stop(app: web.Application) -> None:
        await warm_up.stop()
        await shifter.stop()
        await follower.stop()

    app.on_startup.append(start)
    # At shutdown, before any clean-up: the service's own clean-up (``create_app``) closes the Redis
    # client and the LLM client these loops use, and ran first, so a loop mid-step wrote the split
    # through a closed client (redis-py opened a new connection for it) or set endpoints on a closed
    # LLM client.
    app.on_shutdown.append(stop)


def _resumed(held: int | None, controller: CapacityController) -> int:
    """The real-time count to resume from: ``held`` (the split in force, or the one whose lease lapsed
    within ``held_remembered_s``), within the floors of this pool; the controller's own (the floor)
    when there is none."""
    if held is None:
        return controller.realtime
    s = controller.settings
    return min(max(held, s.realtime_floor), controller.total - s.batch_floor)


async def _start_once_covered(
    meter: LoadMeter, shifter: CapacityShifter, renew_lease: Callable[[], Awaitable[object]], poll_s: float
) -> None:
    """Start ``shifter`` once ``meter`` has measured a whole window since the service started, calling
    ``renew_lease`` every ``poll_s`` until then. A failed renewal is logged and
    retried at the next poll: it must not keep the shifter from starting."""
    while not meter.covered(time.time()):
        try:
            await renew_lease()
        except Exception as exc:
            log.warning("capacity warm-up: renewing the split's lease: %r", exc)
        await asyncio.sleep(poll_s)
    shifter.start()
