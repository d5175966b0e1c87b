"""The request path: route, forward, pass the answer back byte for byte.

Guarantees:
- the replica receives the caller's body unchanged, plus the routing key as ``x-session-id``;
- the caller receives the replica's status, content type and body unchanged; a stream is written on
  chunk by chunk as the replica's chunks arrive (no buffering of a streamed answer);
- failures before the answer starts (refused connection, timeout, 5xx, 429, a replica dying before its
  status line, which for a non-streamed answer comes with the whole body) are retried on another
  replica by the LLM client, under its retry budget and deadline; when none succeeds the caller gets an
  OpenAI-style error body with 502 (the last replica failed), 503 (no replica routable, or retry budget
  spent) or 504 (deadline);
- a replica that breaks off after the first byte cannot be retried (bytes are already with the caller):
  the caller's connection is closed without the stream's end, so it sees a truncated answer, never a
  silently short one;
- a caller that goes away closes the replica's connection too, so the replica stops generating;
- a body of ``offload_body_bytes`` or more is parsed and hashed for routing in a worker thread, so one
  large request does not stall every other request's stream on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import orjson
from aiohttp import web

from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.route import InvalidRequest, models_route, route_for
from llm_client.client import LLMClient
from llm_client.errors import (
    AttemptTimeout,
    DeadlineExceeded,
    LLMError,
    NoHealthyEndpoint,
    RetryBudgetExhausted,
)
from llm_client.passthrough import Forwarded
from llm_client.routing import RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy

log = logging.getLogger(__name__)

FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
"""Caller headers the replica sees (besides ``x-session-id``). Never the caller's ``Authorization``:
the replicas get the gateway's own key (``LLM_SECURITY__API_KEY``), and a caller's key is not theirs."""
PASSED_RESPONSE_HEADERS = ("content-type", "cache-control", "x-replica-id", "x-request-id")
"""Replica headers the caller sees, plus the gateway's ``x-gateway-replica`` and ``x-gateway-attempts``."""


class OpenAIProxy:
    """Handlers for ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``."""

    def __init__(self, client: LLMClient, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.read()
        try:
            if len(body) >= self.settings.offload_body_bytes:
                route = await asyncio.to_thread(self._route, body, request.headers)
            else:
                route = self._route(body, request.headers)
        except InvalidRequest as exc:
            return self._error(request, 400, str(exc), "invalid_request_error", exc.param)
        return await self._forward(request, "POST", body, route, started)

    def _route(self, body: bytes, headers: Mapping[str, str]) -> RouteRequest:
        """The policy's view of the body, with the prompt's block hashes already computed when the
        policy routes by them: parsing and hashing are linear in the body (about 40 ms a MiB), so
        ``generate`` runs this in a worker thread for large bodies and the event loop never waits on
        it. Touches nothing shared: the route is new, and the hashes land in its own ``memo``."""
        route = route_for(
            body,
            headers,
            key_header=self.settings.shopper_key_header,
            default_max_tokens=self.settings.default_max_tokens,
        )
        if isinstance(self.client.policy, PrefixAwarePolicy):
            self.client.policy.block_hashes(route)
        return route

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "GET", None, models_route(), time.perf_counter())

    async def _forward(
        self, request: web.Request, method: str, body: bytes | None, route: RouteRequest, started: float
    ) -> web.StreamResponse:
        headers = {
            name: request.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in request.headers
        }
        response: web.StreamResponse | None = None
        try:
            async with self.client.forward(
                request.path, body, route, method=method, headers=headers, deadline_s=self.settings.deadline_s
            ) as answer:
                if answer.headers.get("content-type", "").startswith("text/event-stream"):
                    response = web.StreamResponse(status=answer.status, headers=_answer_headers(answer))
                    await self._stream(request, response, answer, started)
                else:
                    payload = await answer.read()
                    response = web.Response(
                        body=payload, status=answer.status, headers=_answer_headers(answer)
                    )
        except LLMError as exc:
            if response is None or not response.prepared:
                status, kind = _error_status(exc)
                return self._error(request, status, str(exc), kind, attempts=exc.attempts)
            # Bytes are already with the caller: end its connection without the stream's end.
            self.metrics.broken_streams.labels(exc.endpoint or "unknown").inc()
            log.warning("answer broke off mid-stream: %s", exc)
            if request.transport is not None:
                request.transport.close()
            self.metrics.requests.labels(request.path, "broken").inc()
            return response
        except ConnectionResetError:  # the caller went away; the replica's connection is closed too
            self.metrics.requests.labels(request.path, "caller_gone").inc()
            return response if response is not None else web.Response(status=499)
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        self.metrics.latency.labels(request.path).observe(time.perf_counter() - started)
        return response

    async def _stream(
        self, request: web.Request, response: web.StreamResponse, answer: Forwarded, started: float
    ) -> None:
        await response.prepare(request)
        first = True
        async for chunk in answer.chunks():
            await response.write(chunk)
            if first:
                self.metrics.first_byte.labels(request.path).observe(time.perf_counter() - started)
                first = False
        await response.write_eof()

    def _error(
        self,
        request: web.Request,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        attempts: int = 0,
    ) -> web.Response:
        self.metrics.requests.labels(request.path, str(status)).inc()
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        return web.Response(
            body=orjson.dumps(body),
            status=status,
            content_type="application/json",
            headers={"x-gateway-attempts": str(attempts)},
        )


def _answer_headers(answer: Forwarded) -> dict[str, str]:
    headers = {name: answer.headers[name] for name in PASSED_RESPONSE_HEADERS if name in answer.headers}
    headers["x-gateway-replica"] = answer.endpoint.name
    headers["x-gateway-attempts"] = str(answer.attempts)
    return headers


def _error_status(exc: LLMError) -> tuple[int, str]:
    """The gateway's own answer when no replica answered (OpenAI-style ``error.type``)."""
    if isinstance(exc, DeadlineExceeded | AttemptTimeout):
        return 504, "timeout"
    if isinstance(exc, NoHealthyEndpoint | RetryBudgetExhausted):
        return 503, "service_unavailable"
    return 502, "bad_gateway"
