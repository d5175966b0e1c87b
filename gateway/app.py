"""The gateway's aiohttp application: ``create_app`` builds it, ``serve`` runs it until SIGINT/SIGTERM.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (proxied, see
``gateway.proxy``), ``GET /health`` (200 while at least one replica is routable, else 503, so a load
balancer in front stops sending), ``GET /metrics`` (Prometheus), ``/admin/groups`` (endpoint group
weights, ``gateway.admin``). ``gateway.guard`` checks the caller's API key and the body size before a
proxied route reads anything. One ``LLMClient`` per application owns
the replicas' state (health, load, the policy's cache knowledge); nothing is global.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from gateway.admin import add_admin_routes
from gateway.config import GatewaySettings
from gateway.guard import caller_guard
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.proxy import OpenAIProxy
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from serving.http_service import serve_until_stopped

CLIENT_KEY = web.AppKey("client", LLMClient)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)


def create_app(settings: GatewaySettings, client_config: ClientConfig) -> web.Application:
    """An application with its own LLM client (started and closed with the application)."""
    client = LLMClient(client_under_admission(settings, client_config))
    metrics = GatewayMetrics(client)
    app = web.Application(
        client_max_size=settings.max_body_bytes, middlewares=[caller_guard(settings, metrics)]
    )
    app[CLIENT_KEY] = client
    app[METRICS_KEY] = metrics
    proxy = OpenAIProxy(client, settings, metrics)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app, client)
    app.cleanup_ctx.append(_client_lifetime)

    async def stop_calls(_: web.Application) -> None:
        await proxy.close()  # calls kept running for a repeat end with the gateway

    app.on_shutdown.append(stop_calls)
    return app


def client_under_admission(settings: GatewaySettings, client_config: ClientConfig) -> ClientConfig:
    """``client_config`` with its own in-flight limit raised to admission's ceiling (``max_in_flight``,
    else every configured replica at ``per_replica_in_flight``). The gateway's admission is the limit:
    below it, the client's (256 by default, the lower from five replicas at 64) queued first in first
    out what admission had let through, where priority, the wait bounds and supersede no longer
    applied."""
    replicas = len(client_config.endpoints) + len(client_config.context_endpoints)
    ceiling = settings.max_in_flight or max(1, replicas) * settings.per_replica_in_flight
    if client_config.max_in_flight >= ceiling:
        return client_config
    return client_config.model_copy(update={"max_in_flight": ceiling})


async def _client_lifetime(app: web.Application) -> AsyncIterator[None]:
    async with app[CLIENT_KEY]:
        yield


async def _health(request: web.Request) -> web.Response:
    endpoints = request.app[CLIENT_KEY].endpoints
    routable = sum(e.routable for e in endpoints)
    body = {
        "status": "ok" if routable else "unavailable",
        "routable_replicas": routable,
        "replicas": [
            {"name": e.name, "routable": e.routable, "outstanding": e.outstanding} for e in endpoints
        ],
    }
    return web.Response(
        body=orjson.dumps(body), status=200 if routable else 503, content_type="application/json"
    )


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE})


async def serve(settings: GatewaySettings, client_config: ClientConfig) -> None:
    """Listen on ``settings.host:port`` and print ``READY http://HOST:PORT`` (the real port when 0)."""
    await serve_until_stopped(
        create_app(settings, client_config),
        settings.host,
        settings.port,
        reuse_port=settings.reuse_port or None,
    )
