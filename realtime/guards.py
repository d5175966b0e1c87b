"""The HTTP guard in front of every non-public route: rate limit, API key, body size.

Order, cheapest refusal first and never reading a body it will refuse:

1. **rate limit** (429, ``Retry-After``): one token bucket per client, keyed by the API-key id when the
   request carries a valid key, else by the remote address, so a caller guessing keys is limited by
   its address;
2. **API key** (401, ``WWW-Authenticate``), when keys are configured; compared in constant time
   (``realtime.auth``);
3. **declared body size** (413) from ``Content-Length``, before anything is read; a chunked body is
   cut at the same limit by aiohttp's ``client_max_size`` while it is read (also a JSON 413).

Paths in ``settings.public_paths`` (health, metrics, the spec) pass untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from realtime.auth import ApiKeyAuthenticator, presented_key
from realtime.config import RealtimeSettings
from realtime.http_errors import Handler, error_response
from realtime.metrics import RealtimeMetrics
from realtime.rate_limit import ClientRateLimiter, retry_after_header


def security_guard(
    settings: RealtimeSettings, metrics: RealtimeMetrics, *, clock: Callable[[], float] = time.monotonic
) -> Middleware:
    """An aiohttp middleware applying ``settings``' rate limit, API keys and body-size limit."""
    auth = ApiKeyAuthenticator(settings.api_keys)
    limiter = ClientRateLimiter(
        settings.rate_limit_per_s, settings.rate_limit_burst, settings.rate_limit_max_clients, clock
    )
    public = frozenset(settings.public_paths)
    limit = settings.max_body_bytes
    identify = auth.required or limiter.enabled  # else only the body size is checked

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in public:
            return await handler(request)
        if not identify:
            return await _sized(request, handler)
        client = auth.client_id(
            presented_key(request.headers.get("Authorization"), request.headers.get("X-API-Key"))
        )
        wait_s = limiter.retry_after_s(client or f"addr:{request.remote or 'unknown'}")
        if wait_s > 0:
            metrics.rejected.labels("rate_limited").inc()
            return error_response(
                429,
                "rate_limited",
                f"more than {settings.rate_limit_per_s:g} requests a second (burst "
                f"{settings.rate_limit_burst}) from this client; retry after {wait_s:.2f} s",
                headers={"Retry-After": retry_after_header(wait_s)},
            )
        if auth.required and client is None:
            metrics.rejected.labels("unauthorized").inc()
            return error_response(
                401,
                "unauthorized",
                "a valid API key is required: send it as 'X-API-Key: <key>' or 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": 'Bearer realm="shopper-realtime"'},
            )
        return await _sized(request, handler)

    async def _sized(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limit:
            metrics.rejected.labels("payload_too_large").inc()
            return error_response(
                413,
                "payload_too_large",
                f"the body is {request.content_length} bytes; the limit is {limit} bytes",
            )
        return await handler(request)

    return guard
