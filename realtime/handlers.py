"""The routes: ``POST /v1/match``, ``GET /health``, ``/metrics`` and ``/openapi.json``.

Handlers only translate between HTTP and ``MatchService``: content type and JSON checks (415, 400),
deadline-aware admission (429 ``overloaded`` with ``Retry-After``, before any other work:
``realtime.admission``), field validation with every offending field named (422), then the match itself.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from pydantic import ValidationError
from redis.exceptions import RedisError

from realtime.admission import request_age_s
from realtime.http_errors import error_response, json_response
from realtime.matching import MatchService
from realtime.models import ErrorDetail, HealthResponse, MatchRequest
from realtime.openapi import openapi_spec
from realtime.rate_limit import retry_after_header

SERVICE_KEY = web.AppKey("match_service", MatchService)
_JSON_TYPES = frozenset(("application/json", "application/octet-stream"))


async def match(request: web.Request) -> web.Response:
    arrived = time.perf_counter()
    # The age at arrival, read before the body: admission adds the time since ``arrived`` (a body that
    # trickles in spends the deadline too), and the match counts from ``arrived - waited_s``; an age read
    # after the body counted its read twice there.
    waited_s = request_age_s(request.headers.get("X-Request-Start"))
    service = request.app[SERVICE_KEY]
    if request.content_type not in _JSON_TYPES:
        service.metrics.rejected.labels("unsupported_media_type").inc()
        return error_response(
            415, "unsupported_media_type", f"send application/json, not {request.content_type}"
        )
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        service.metrics.rejected.labels("invalid_json").inc()
        return error_response(400, "invalid_json", f"the body is not valid JSON: {exc}")
    except web.RequestPayloadError as exc:  # a body that cannot be read as sent (Content-Encoding, chunks)
        service.metrics.rejected.labels("invalid_json").inc()
        why = " ".join(str(exc).split())  # aiohttp's text spans lines
        return error_response(400, "invalid_json", f"the body could not be read: {why}")
    refused = service.refusal(service.deadline_ms(data), waited_s, time.perf_counter() - arrived)
    if refused is not None:
        # 429, not 503: a refusal by design, with the same Retry-After contract as the rate limit; a 5xx
        # stays what it says, a failure of the service.
        service.metrics.rejected.labels("overloaded").inc()
        retry_after_s, why = refused
        return error_response(
            429, "overloaded", why, headers={"Retry-After": retry_after_header(retry_after_s)}
        )
    try:
        match_request = MatchRequest.model_validate(data)
    except ValidationError as exc:
        service.metrics.rejected.labels("validation_error").inc()
        details = [
            ErrorDetail(loc=".".join(str(p) for p in e["loc"]) or "body", msg=e["msg"]) for e in exc.errors()
        ]
        return error_response(
            422,
            "validation_error",
            f"{len(details)} invalid field(s): {details[0].loc}: {details[0].msg}",
            details,
        )
    return json_response(await service.match(match_request, arrived, waited_s or 0.0))


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    redis_state = "ok"
    try:
        async with asyncio.timeout(0.2):
            await service.redis.ping()
    except (TimeoutError, RedisError, OSError):
        redis_state = "down"
    body = HealthResponse(
        status="ok",
        llm_replicas=len(service.llm.endpoints),
        llm_routable=sum(1 for e in service.llm.endpoints if e.routable),
        redis=redis_state,
    )
    return json_response(body.model_dump(mode="json"))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[SERVICE_KEY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_spec())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/match", match)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
