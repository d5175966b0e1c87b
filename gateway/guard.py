"""The HTTP guard in front of the proxied routes: caller API key (or the admin key), then body size.

Cheapest refusal first, and never reading a body it will refuse:

1. **API key** (401, ``WWW-Authenticate: Bearer``), when ``GatewaySettings.api_key`` is set: the caller
   sends ``Authorization: Bearer <key>``, as every OpenAI SDK does with its ``api_key``. The presented and
   the configured key are compared as SHA-256 digests with ``hmac.compare_digest``: constant time, and
   the comparison does not even leak the key's length. The caller's key is never forwarded (replicas
   get the gateway's own, ``LLM_SECURITY__API_KEY``).
2. **Body size** (413): a declared ``Content-Length`` over ``max_body_bytes`` is refused before anything
   is read; a chunked body is cut at the same limit by aiohttp's ``client_max_size`` while it is read,
   and that refusal is turned into the same JSON 413 here.

The admin routes (``ADMIN_PREFIX``: live group weights, ``gateway.admin``) take the operators' own key,
``GatewaySettings.admin_api_key``, checked the same way; the callers' key does not open them. With no
admin key set they answer 403: changing the routing needs a credential someone chose for it.

Paths in ``GatewaySettings.public_paths`` (``/health``, ``/metrics``) pass untouched. Every refusal is an
OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import SecretStr

from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

BEARER = "bearer "
ADMIN_PREFIX = "/admin/"
"""Routes behind the admin key instead of the callers' key."""


class BearerKeyCheck:
    """Accepts ``Authorization: Bearer <key>`` for the one configured key; keeps only its digest."""

    def __init__(self, key: SecretStr | None) -> None:
        self._digest = None if key is None else _digest(key.get_secret_value())

    @property
    def required(self) -> bool:
        return self._digest is not None

    def accepts(self, authorization: str | None) -> bool:
        if self._digest is None:
            return True
        if not authorization or authorization[: len(BEARER)].lower() != BEARER:
            return False
        return hmac.compare_digest(_digest(authorization[len(BEARER) :].strip()), self._digest)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def error_response(
    status: int, message: str, kind: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """The gateway's own error, shaped as OpenAI's."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def route_label(request: web.Request) -> str:
    """The metrics' ``path`` label of a refused request: the route it matched (its template), or
    ``unmatched``. The path itself is the caller's to choose: labelled by it, requests without a key
    minted a series each (``/junk-0``, ``/junk-1``, ...) and grew ``/metrics`` without bound."""
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical


def caller_guard(settings: GatewaySettings, metrics: GatewayMetrics) -> Middleware:
    """An aiohttp middleware applying ``settings``' API key and body-size limit."""
    keys = BearerKeyCheck(settings.api_key)
    admin_keys = BearerKeyCheck(settings.admin_api_key)
    public = frozenset(settings.public_paths)
    limit = settings.max_body_bytes

    def too_large(request: web.Request, size: str) -> web.Response:
        metrics.requests.labels(route_label(request), "413").inc()
        return error_response(
            413,
            f"the body is {size}; the limit is {limit} bytes (GATEWAY_MAX_BODY_BYTES)",
            "payload_too_large",
        )

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in public:
            return await handler(request)
        admin = request.path.startswith(ADMIN_PREFIX) or request.path == ADMIN_PREFIX.rstrip("/")
        if admin and not admin_keys.required:
            metrics.requests.labels(route_label(request), "403").inc()
            return error_response(
                403,
                "the admin routes are off: they need a key of their own (GATEWAY_ADMIN_API_KEY)",
                "permission_error",
            )
        if not (admin_keys if admin else keys).accepts(request.headers.get("Authorization")):
            metrics.requests.labels(route_label(request), "401").inc()
            which = "admin key" if admin else "API key"
            return error_response(
                401,
                f"a valid {which} is required: send it as 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": 'Bearer realm="shopper-gateway"'},
            )
        if request.content_length is not None and request.content_length > limit:
            return too_large(request, f"{request.content_length} bytes")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return too_large(request, f"over {limit} bytes")

    return guard
