"""JSON error answers: every 4xx/5xx the service sends has the ``ErrorResponse`` shape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import Counter

from realtime.models import ErrorDetail, ErrorInfo, ErrorResponse, ErrorType

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS_TYPES: dict[int, ErrorType] = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
}


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def error_response(
    status: int,
    error_type: ErrorType,
    message: str,
    details: list[ErrorDetail] | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = ErrorResponse(error=ErrorInfo(type=error_type, message=message, details=details or []))
    return json_response(body.model_dump(mode="json"), status, headers)


def errors_as_json(rejected: Counter) -> Middleware:
    """aiohttp's own 4xx (no route, wrong method, body over ``client_max_size`` when it came chunked)
    as JSON errors, counted in ``rejected`` by type as the service's own 4xx are; and, as the last line,
    any exception a handler lets through as a JSON 500 ``internal_error`` (the traceback goes to the
    log, never to the caller). Failures the service expects (the model's, Redis') never get here: they
    are degraded answers (``realtime.matching``)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error_type = _STATUS_TYPES.get(exc.status)
            if error_type is not None:  # a 4xx of a type the API names (not one it cannot)
                rejected.labels(error_type).inc()
            headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
            return error_response(exc.status, error_type or "internal_error", exc.reason, headers=headers)
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the caller went away: nobody to answer
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            return error_response(500, "internal_error", "the service failed to answer this request")

    return middleware
