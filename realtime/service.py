"""The real-time matching service as an aiohttp application: ``create_app`` wires the parts together.

The parts, one job each: ``matching`` (one request: signals, fallback, the model within the deadline),
``signals`` (the Redis read), ``handlers`` (HTTP <-> ``MatchService``), ``guards`` with ``auth`` and
``rate_limit`` (API keys, per-client rate limit, body size), ``http_errors`` (every error as JSON),
``metrics``, ``load_meter`` and ``loop_lag`` (what the service measures), ``llm_pool`` (the latency
pool's client settings). The names other packages use are re-exported here.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web

from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from realtime.config import RealtimeSettings
from realtime.guards import security_guard
from realtime.handlers import SERVICE_KEY, add_routes
from realtime.http_errors import errors_as_json
from realtime.llm_pool import realtime_client_config
from realtime.load_meter import LoadMeter
from realtime.loop_lag import LoopLag
from realtime.matching import MatchService
from realtime.metrics import RealtimeMetrics
from sinks.config import SinkSettings

__all__ = [
    "SERVICE_KEY",
    "LoadMeter",
    "LoopLag",
    "MatchService",
    "RealtimeMetrics",
    "create_app",
    "realtime_client_config",
]


def create_app(
    settings: RealtimeSettings,
    *,
    llm_config: ClientConfig | None = None,
    sinks: SinkSettings | None = None,
    llm: LLMClient | None = None,
    redis: aioredis.Redis | None = None,
) -> web.Application:
    """The service as an aiohttp application. Clients given are used as they are (and not closed);
    otherwise they are built from ``llm_config`` / ``sinks`` on start-up and closed on clean-up
    (Redis with the sink settings' credentials and CA, see ``SinkSettings.redis_client``)."""
    sinks = sinks or SinkSettings()
    metrics = RealtimeMetrics()
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[errors_as_json(metrics.rejected), security_guard(settings, metrics)],
    )
    client = llm or LLMClient(llm_config or realtime_client_config(["http://127.0.0.1:8000"], "default"))
    store = redis or sinks.redis_client()
    app[SERVICE_KEY] = MatchService(settings, client, store, sinks.redis_key_prefix, metrics, LoadMeter())
    metrics.watch_cut_calls(client.cut_calls)
    metrics.watch_replicas(lambda: client.endpoints)

    async def start(app: web.Application) -> None:
        app[SERVICE_KEY].lag.start()
        if llm is None:
            await client.start()

    async def stop(app: web.Application) -> None:
        await app[SERVICE_KEY].lag.stop()
        if llm is None:
            await client.close()
        if redis is None:
            await store.aclose()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    add_routes(app)
    return app
