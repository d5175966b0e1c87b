"""The front end's routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (``service``),
``GET /perf_metrics`` (``perf_metrics``) and ``GET /health`` (200, with the request counters).

A body that is not a valid OpenAI request is answered 400 ``{"error": ...}``, as TensorRT-LLM's
validation handler does; any failure after that is 500 ``{"detail": "Internal server error ..."}``, as
its ``_handle_exception`` answers (a worker's 4xx included: the front end does not pass statuses on).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict

import aiohttp
import orjson
from aiohttp import web
from pydantic import ValidationError

from serving.disagg_router.config import DisaggConfig
from serving.disagg_router.errors import DisaggError
from serving.disagg_router.service import DisaggService
from serving.disagg_router.workers import RetryPolicy, Workers
from serving.simulator.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", DisaggService)


def create_app(
    config: DisaggConfig, *, request_timeout_s: float = 180.0, retry_interval_s: float = 1.0
) -> web.Application:
    """The front end for ``config``; its worker session opens and closes with the app.
    ``request_timeout_s`` bounds each worker request (TensorRT-LLM's ``req_timeout_secs``)."""
    app = web.Application()

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            retry = RetryPolicy(config.max_retries, retry_interval_s)
            app[SERVICE] = DisaggService(config, Workers(session, retry))
            yield

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/perf_metrics", _perf_metrics)
    app.router.add_get("/health", _health)
    return app


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatCompletionRequest)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest)


async def _generate(
    request: web.Request, model: type[ChatCompletionRequest] | type[CompletionRequest]
) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict):
            return _json({"error": "the request body must be a JSON object"}, 400)
        parsed = model.model_validate(body)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        return _json({"error": str(exc)}, 400)
    try:
        return await request.app[SERVICE].serve(request, body, parsed)
    except DisaggError as exc:  # raised before any answer went out (a broken stream just ends)
        log.warning("request failed: %s", exc)
        return _json({"detail": f"Internal server error {exc}"}, 500)


async def _perf_metrics(request: web.Request) -> web.Response:
    try:
        records = await request.app[SERVICE].collect_perf_metrics()
    except DisaggError as exc:
        return _json({"detail": f"Internal server error {exc}"}, 500)
    return web.Response(body=orjson.dumps(records), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return _json({"status": "ok", **asdict(request.app[SERVICE].counters)}, 200)


def _json(body: object, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
