"""Start simulated replicas inside a test's event loop, on free ports, over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from serving.simulator.app import create_app
from serving.simulator.config import SimulatorConfig
from serving.simulator.replica import REPLICA_KEY, Replica


@dataclass(frozen=True)
class RunningSimulator:
    """A replica listening on ``url``; ``replica`` gives tests direct access to its state."""

    url: str
    app: web.Application

    @property
    def replica(self) -> Replica:
        return self.app[REPLICA_KEY]


@asynccontextmanager
async def running_simulator(**settings: Any) -> AsyncIterator[RunningSimulator]:
    """Serve one replica on 127.0.0.1 and a free port until the block exits.

    ``settings`` are ``SimulatorConfig`` fields (validated; ``SIM_*`` variables fill the rest).
    """
    settings.setdefault("host", "127.0.0.1")
    settings["port"] = 0
    config = SimulatorConfig(**settings)
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)  # as ``serve`` runs it
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield RunningSimulator(f"http://{config.host}:{port}", app)
    finally:
        await runner.cleanup()
