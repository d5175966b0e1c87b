"""The real-time matching service (aiohttp): ``POST /v1/match``, ``/health``, ``/metrics``, ``/openapi.json``.

Request path: validate (4xx with the offending field), read the shopper's and the candidates' signals
from Redis in one round trip (bounded by ``redis_timeout_ms``), compute the fallback ranking
(microseconds), then ask the real-time pool to rank within what is left of the deadline. The answer
leaves before the deadline: if the model misses it, errs, the pool is down or already holds as many
calls as it can serve in time (``llm_concurrency_per_replica``), the fallback ranking goes out marked
``degraded: true`` with the reason. The time kept back for answering is ``answer_reserve_ms`` plus the
event loop's recent lag, so a busy host makes the service give up on the model earlier instead of
answering late. A call abandoned at the deadline is cancelled, which closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from redis.exceptions import RedisError

from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from llm_client.errors import (
    AttemptTimeout,
    DeadlineExceeded,
    EndpointUnavailable,
    LLMError,
    NoHealthyEndpoint,
    RetryBudgetExhausted,
)
from realtime.config import RealtimeSettings
from realtime.models import (
    DegradedReason,
    ErrorDetail,
    ErrorInfo,
    ErrorResponse,
    HealthResponse,
    MatchRequest,
    MatchResponse,
    SignalsUsed,
)
from realtime.openapi import openapi_spec
from realtime.ranking import (
    ProductProfile,
    ShopperProfile,
    fallback_ranking,
    parse_ranking,
    ranking_messages,
    ranking_response_format,
)
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

_MAX_BODY_BYTES = 256 * 1024
_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0, 2.5)
_UNAVAILABLE = (EndpointUnavailable, NoHealthyEndpoint, RetryBudgetExhausted, AttemptTimeout)


def realtime_client_config(endpoints: list[str], model: str, **overrides: object) -> ClientConfig:
    """LLM client settings for a latency pool: no streaming (one write per answer), least outstanding
    requests, one quick retry elsewhere, no client-side queue (the service sheds instead)."""
    options: dict[str, object] = {
        "endpoints": endpoints,
        "model": model,
        "policy": "least_outstanding",
        "stream": False,
        "max_in_flight": 1_000_000,
        "timeouts": {"connect_s": 0.5, "attempt_s": 5.0, "deadline_s": 5.0},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.002, "backoff_max_s": 0.01},
        "health": {"interval_s": 0.5, "eject_after_failures": 2},
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]


class RealtimeMetrics:
    """Prometheus metrics in a per-app registry (several services can share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("realtime_requests", "answered match requests", ["outcome"], registry=r)
        self.degraded = Counter("realtime_degraded", "fallback answers by reason", ["reason"], registry=r)
        self.rejected = Counter("realtime_rejected", "4xx answers by error type", ["type"], registry=r)
        self.elapsed = Histogram(
            "realtime_request_seconds", "arrival to answer", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.llm = Histogram(
            "realtime_llm_seconds", "waiting for the model", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.overhead = Histogram(
            "realtime_overhead_seconds",
            "answer time not spent waiting for the model",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=r,
        )
        self.llm_in_flight = Gauge("realtime_llm_in_flight", "model calls in flight", registry=r)
        self.signal_errors = Counter(
            "realtime_signal_errors", "Redis reads that failed or timed out", registry=r
        )


class LoadMeter:
    """Requests per second over a sliding window: the capacity controller's input."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._buckets: dict[int, int] = {}

    def hit(self, now: float) -> None:
        second = int(now)
        self._buckets[second] = self._buckets.get(second, 0) + 1
        if len(self._buckets) > 4 * self.window_s:
            for old in [s for s in self._buckets if s < second - self.window_s]:
                del self._buckets[old]

    def rate(self, now: float) -> float:
        """Mean rate over the last ``window_s`` full seconds."""
        current = int(now)
        seconds = range(current - int(self.window_s), current)
        return sum(self._buckets.get(s, 0) for s in seconds) / self.window_s


class LoopLag:
    """How late the event loop runs timers, over the last second (a sleep's overshoot).

    On a busy host a request can wait in the socket before its handler starts, and its answer can
    wait again before it is written; the service cannot see those waits, but it can see the loop's
    lag and start answering that much earlier.
    """

    def __init__(self, interval_s: float = 0.01, window: int = 100) -> None:
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._task: asyncio.Task[None] | None = None

    @property
    def recent_s(self) -> float:
        return max(self._samples, default=0.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._measure(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.interval_s)
            self._samples.append(max(loop.time() - started - self.interval_s, 0.0))


@dataclass
class MatchService:
    settings: RealtimeSettings
    llm: LLMClient
    redis: aioredis.Redis
    key_prefix: str
    metrics: RealtimeMetrics
    load: LoadMeter
    lag: LoopLag = field(default_factory=LoopLag)

    async def match(self, request: MatchRequest, arrived: float) -> MatchResponse:
        loop = asyncio.get_running_loop()
        s = self.settings
        deadline_ms = request.deadline_ms or s.default_deadline_ms
        reserve_s = s.answer_reserve_ms / 1000 + min(self.lag.recent_s, s.max_lag_reserve_ms / 1000)
        answer_by = arrived + deadline_ms / 1000 - reserve_s
        self.load.hit(time.time())

        shopper: ShopperProfile | None = None
        products: dict[str, ProductProfile] = {}
        try:
            async with asyncio.timeout(max(min(s.redis_timeout_ms / 1000, answer_by - loop.time()), 0)):
                shopper, products = await self._signals(request)
        except (TimeoutError, RedisError, OSError):
            self.metrics.signal_errors.inc()
        fallback = fallback_ranking(shopper, request.query, request.candidates, products, s.reason_max_chars)

        ranked, reason, llm_ms, model = fallback, None, None, None
        routable = sum(1 for e in self.llm.endpoints if e.routable)
        remaining = answer_by - loop.time()
        if routable == 0:
            reason = "llm_unavailable"
        elif self.llm.in_flight >= routable * s.llm_concurrency_per_replica:
            reason = "overloaded"
        elif remaining < 0.005:
            reason = "deadline"
        else:
            started = loop.time()
            ranked, reason, model = await self._ask(request, shopper, products, fallback, remaining)
            llm_ms = (loop.time() - started) * 1000
            self.metrics.llm.observe(llm_ms / 1000)

        elapsed_ms = (loop.time() - arrived) * 1000
        self.metrics.elapsed.observe(elapsed_ms / 1000)
        self.metrics.overhead.observe(max(elapsed_ms - (llm_ms or 0.0), 0.0) / 1000)
        self.metrics.requests.labels("degraded" if reason else "llm").inc()
        if reason:
            self.metrics.degraded.labels(reason).inc()
        return MatchResponse(
            shopper_id=request.shopper_id,
            ranked=ranked,
            degraded=reason is not None,
            degraded_reason=reason,
            model=model,
            llm_ms=None if llm_ms is None else round(llm_ms, 3),
            elapsed_ms=round(elapsed_ms, 3),
            deadline_ms=deadline_ms,
            signals=SignalsUsed(shopper=shopper is not None, products=len(products)),
        )

    async def _ask(
        self,
        request: MatchRequest,
        shopper: ShopperProfile | None,
        products: dict[str, ProductProfile],
        fallback: list[Any],
        remaining_s: float,
    ) -> tuple[list[Any], DegradedReason | None, str | None]:
        s = self.settings
        messages = ranking_messages(shopper, request.query, request.candidates, products, s.llm_top_k)
        self.metrics.llm_in_flight.inc()
        try:
            completion = await self.llm.chat(
                messages,
                routing_key=request.shopper_id,
                max_tokens=s.llm_max_tokens,
                response_format=ranking_response_format(request.candidates, s.llm_top_k, s.reason_max_chars),
                deadline_s=remaining_s,
            )
        except (DeadlineExceeded, TimeoutError):
            return fallback, "deadline", None
        except _UNAVAILABLE:
            return fallback, "llm_unavailable", None
        except LLMError:
            return fallback, "llm_error", None
        finally:
            self.metrics.llm_in_flight.dec()
        try:
            return parse_ranking(completion.text, fallback, s.reason_max_chars), None, completion.model
        except ValueError:
            return fallback, "invalid_answer", completion.model

    def __post_init__(self) -> None:
        self._read_signals = self.redis.register_script(_READ_SIGNALS)

    async def _signals(
        self, request: MatchRequest
    ) -> tuple[ShopperProfile | None, dict[str, ProductProfile]]:
        """The shopper's and the candidates' signals in one round trip, only the fields the ranking
        uses. Parsing Redis replies is most of the service's CPU, so on a single Redis node one Lua
        call returns everything as one JSON string (about 5x cheaper than a pipeline of HMGETs); on
        Redis Cluster (keys in different slots) a pipeline is used (``signal_reads``)."""
        keys = [RedisKeys(self.key_prefix).signals(request.shopper_id)]
        keys += [RedisKeys(self.key_prefix).product(c.product_id) for c in request.candidates]
        if self.settings.signal_reads == "script":
            args: list[str | int] = [
                len(ShopperProfile.FIELDS),
                *ShopperProfile.FIELDS,
                *ProductProfile.FIELDS,
            ]
            replies = orjson.loads(await self._read_signals(keys=keys, args=args))
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(keys[0], list(ShopperProfile.FIELDS))
            for key in keys[1:]:
                pipe.hmget(key, list(ProductProfile.FIELDS))
            replies = await pipe.execute()
        products = {}
        for c, values in zip(request.candidates, replies[1:], strict=True):
            profile = ProductProfile.from_values(values)
            if profile is not None:
                products[c.product_id] = profile
        return ShopperProfile.from_values(replies[0]), products


_READ_SIGNALS = """
local n = tonumber(ARGV[1])
local shopper_fields = {}
for i = 2, n + 1 do shopper_fields[#shopper_fields + 1] = ARGV[i] end
local product_fields = {}
for i = n + 2, #ARGV do product_fields[#product_fields + 1] = ARGV[i] end
local out = {redis.call('HMGET', KEYS[1], unpack(shopper_fields))}
for i = 2, #KEYS do out[i] = redis.call('HMGET', KEYS[i], unpack(product_fields)) end
return cjson.encode(out)
"""
"""HMGET of the shopper's key and every product key, as one JSON array (missing fields: false)."""


SERVICE_KEY = web.AppKey("match_service", MatchService)

_STATUS_TYPES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(
    status: int, error_type: str, message: str, details: list[ErrorDetail] | None = None
) -> web.Response:
    body = ErrorResponse(error=ErrorInfo(type=error_type, message=message, details=details or []))
    return _json(body.model_dump(mode="json"), status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, _STATUS_TYPES.get(exc.status, "internal_error"), exc.reason)


async def _match(request: web.Request) -> web.Response:
    arrived = asyncio.get_running_loop().time()
    service = request.app[SERVICE_KEY]
    if request.content_type not in ("application/json", "application/octet-stream"):
        service.metrics.rejected.labels("unsupported_media_type").inc()
        return _error(415, "unsupported_media_type", f"send application/json, not {request.content_type}")
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        service.metrics.rejected.labels("invalid_json").inc()
        return _error(400, "invalid_json", f"the body is not valid JSON: {exc}")
    try:
        match_request = MatchRequest.model_validate(data)
    except ValidationError as exc:
        service.metrics.rejected.labels("validation_error").inc()
        details = [
            ErrorDetail(loc=".".join(str(p) for p in e["loc"]) or "body", msg=e["msg"]) for e in exc.errors()
        ]
        return _error(
            422,
            "validation_error",
            f"{len(details)} invalid field(s): {details[0].loc}: {details[0].msg}",
            details,
        )
    response = await service.match(match_request, arrived)
    return _json(response.model_dump(mode="json"))


async def _health(request: web.Request) -> web.Response:
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
    return _json(body.model_dump(mode="json"))


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[SERVICE_KEY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _openapi(request: web.Request) -> web.Response:
    return _json(openapi_spec())


def create_app(
    settings: RealtimeSettings,
    *,
    llm_config: ClientConfig | None = None,
    sinks: SinkSettings | None = None,
    llm: LLMClient | None = None,
    redis: aioredis.Redis | None = None,
) -> web.Application:
    """The service as an aiohttp application. Clients given are used as they are (and not closed);
    otherwise they are built from ``llm_config`` / ``sinks`` on start-up and closed on clean-up."""
    sinks = sinks or SinkSettings()
    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_errors_as_json])
    client = llm or LLMClient(llm_config or realtime_client_config(["http://127.0.0.1:8000"], "default"))
    store = redis or aioredis.Redis.from_url(sinks.redis_url)
    app[SERVICE_KEY] = MatchService(
        settings, client, store, sinks.redis_key_prefix, RealtimeMetrics(), LoadMeter()
    )

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
    app.router.add_post("/v1/match", _match)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app
