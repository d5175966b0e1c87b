"""One match request, start to answer: signals, the fallback ranking, then the model within what is left
of the deadline.

A request that cannot be answered in time at all is refused before any work
(``realtime.admission``, asked by the handler through ``refusal``). The deadline counts from the
caller's ``X-Request-Start`` when it sends one, else from arrival.

The answer leaves before the deadline: if the model misses it, errs, the pool is down or already holds
as many calls as it can serve in time (``llm_concurrency_per_replica``), the fallback ranking goes out
marked ``degraded: true`` with the reason. The time kept back for answering is ``answer_reserve_ms``
plus the event loop's recent lag, so a busy host makes the service give up on the model earlier instead
of answering late. A model call cut at the deadline reads on within a short grace, so its connection is
kept (``llm_client.cut_calls``); one that does not finish within it is closed, which tells the replica to
stop.

An answer of the wrong shape or types, in the model's text (``ranking.parse_ranking``) or in the
replica's envelope, is ``invalid_answer``: the fallback again, never a 500.

A failed signal read and a model call that failed (``llm_unavailable``, ``llm_error``,
``invalid_answer``) are counted and logged with their cause, at most one line per reason per
``LOG_INTERVAL_S`` (``failure_log.ThrottledLog``): under an outage every request fails alike. A model call
cut at the deadline (``deadline``) or not made for load (``overloaded``) is normal under load: counted,
not logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llm_client.client import LLMClient
from llm_client.errors import (
    AttemptTimeout,
    DeadlineExceeded,
    EndpointUnavailable,
    InvalidAnswer,
    LLMError,
    NoHealthyEndpoint,
    RetryBudgetExhausted,
)
from realtime.admission import MODEL_FLOOR_QUANTILE, DeadlineAdmission, RecentQuantile
from realtime.config import RealtimeSettings
from realtime.failure_log import ThrottledLog
from realtime.load_meter import LoadMeter
from realtime.loop_lag import LoopLag
from realtime.metrics import RealtimeMetrics
from realtime.models import MAX_DEADLINE_MS, MIN_DEADLINE_MS, DegradedReason, MatchRequest
from realtime.ranking import (
    ProductProfile,
    Ranked,
    ShopperProfile,
    fallback_ranking,
    parse_ranking,
    ranking_messages,
    ranking_response_format,
)
from realtime.signals import SignalReader

_UNAVAILABLE = (EndpointUnavailable, NoHealthyEndpoint, RetryBudgetExhausted, AttemptTimeout)
_MIN_MODEL_S = 0.005
"""Never ask the model with less than this left."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SignalsFound:
    """``models.SignalsUsed``, field for field."""

    shopper: bool
    products: int


@dataclass(frozen=True, slots=True)
class MatchAnswer:
    """The answer as the service builds it: ``models.MatchResponse``, field for field and in its order
    (orjson writes it as that object; a test validates served answers against the model). Slotted
    dataclasses rather than the pydantic models: the service writes its own values, and building and
    dumping the models cost more than the ranking."""

    shopper_id: str
    ranked: list[Ranked]
    degraded: bool
    degraded_reason: DegradedReason | None
    model: str | None
    llm_ms: float | None
    elapsed_ms: float
    deadline_ms: int
    signals: SignalsFound


@dataclass
class MatchService:
    """The matching decision for one request; owns no connections (``create_app`` does)."""

    settings: RealtimeSettings
    llm: LLMClient
    redis: aioredis.Redis
    key_prefix: str
    metrics: RealtimeMetrics
    load: LoadMeter
    lag: LoopLag = field(default_factory=LoopLag)
    failures: ThrottledLog = field(default_factory=lambda: ThrottledLog(log))
    """Why signal reads and model calls fail, in the log: a line per reason per interval at most."""

    def __post_init__(self) -> None:
        self.signals = SignalReader(self.redis, self.key_prefix, self.settings.signal_reads)
        self.admission = DeadlineAdmission(self.settings.answer_reserve_ms / 1000)
        self.model_time = RecentQuantile(MODEL_FLOOR_QUANTILE, initial_s=_MIN_MODEL_S)
        """How fast the model answers when it does: less time left than this, and it is not asked."""
        self._late_reads: set[asyncio.Future[Any]] = set()
        """Signal reads the requests stopped waiting for, kept referenced until they finish; at most
        ``max_late_reads``: a Redis that accepts connections but answers nothing (a stalled server, a
        dropped route) left one read and one connection per request, until the process ran out of file
        descriptors and could not accept a request at all."""
        self.metrics.late_signal_reads.set_function(lambda: len(self._late_reads))
        self.asking = 0
        """Model calls in flight from this service; ``/metrics`` reads it at scrape time (a gauge
        updated per call took a lock twice a request for a number nobody reads between scrapes)."""
        self.metrics.llm_in_flight.set_function(lambda: self.asking)

    def deadline_ms(self, body: object) -> int:
        """The request's deadline before validation (the admission decision comes first): its
        ``deadline_ms`` when that is a valid one, else the default."""
        value = body.get("deadline_ms") if isinstance(body, dict) else None
        if type(value) is int and MIN_DEADLINE_MS <= value <= MAX_DEADLINE_MS:
            return value
        return self.settings.default_deadline_ms

    def refusal(
        self, deadline_ms: int, waited_s: float | None, handled_s: float = 0.0
    ) -> tuple[float, str] | None:
        """None to admit; else (``Retry-After`` seconds, why) for a request that cannot be answered
        within ``deadline_ms`` (``realtime.admission``). ``waited_s``: its age at arrival by
        ``X-Request-Start`` (None: the loop's lag stands in); ``handled_s``: the time since its handler
        started, the body's read above all, added either way: a body arriving 400 ms after its headers
        was admitted against a 300 ms deadline and answered late.
        Every request asked about counts in the load meter, refused or not: the demand the capacity
        controller sees (``realtime.shifting``) includes what could not be served."""
        self.load.hit(time.time())
        lag_s = self.lag.current_s
        waited = (lag_s if waited_s is None else waited_s) + handled_s
        now = time.monotonic()
        retry_after = self.admission.refusal(waited, deadline_ms / 1000, lag_s, now)
        if retry_after is None:
            return None
        needed_ms = self.admission.needed_s(lag_s, now) * 1000
        why = (
            f"cannot answer within the {deadline_ms} ms deadline: the request is {waited * 1000:.0f} ms "
            f"old and an answer takes {needed_ms:.0f} ms now; retry after {retry_after:.0f} s"
        )
        return retry_after, why

    async def match(self, request: MatchRequest, arrived: float, waited_s: float = 0.0) -> MatchAnswer:
        """The answer, before ``deadline_ms`` counted from ``arrived - waited_s`` (``time.perf_counter``).

        Times are read from ``perf_counter``, not the loop's clock: uvloop's ``loop.time()`` counts whole
        milliseconds, so ``llm_ms``, ``elapsed_ms`` and the overhead histogram were whole milliseconds,
        and an overhead read as a latency less ``llm_ms`` was off by up to 1 ms either way."""
        s = self.settings
        deadline_ms = request.deadline_ms or s.default_deadline_ms
        reserve_s = s.answer_reserve_ms / 1000 + min(self.lag.recent_s, s.max_lag_reserve_ms / 1000)
        answer_by = arrived - waited_s + deadline_ms / 1000 - reserve_s

        shopper: ShopperProfile | None = None
        products: dict[str, ProductProfile] = {}
        # The request stops waiting for Redis at the timeout, but the read itself is not cancelled: a
        # cancelled read closes its connection, and under overload (half the reads late at 2x) every
        # next read then paid for a new connection and its handshake, which made the overload worse.
        read = asyncio.ensure_future(self.signals.read(request))
        read_timeout_s = max(min(s.redis_timeout_ms / 1000, answer_by - time.perf_counter()), 0)
        try:
            async with asyncio.timeout(read_timeout_s):
                shopper, products = await asyncio.shield(read)
        except TimeoutError:
            self._stop_waiting(read)
            self.metrics.signal_errors.inc()
            self.failures.warning(
                "signal_timeout",
                "signal read from Redis not answered within %.0f ms: ranked without signals",
                read_timeout_s * 1000,
            )
        except (RedisError, OSError, ValueError) as exc:  # ValueError: bytes not the signal's in Redis
            self.metrics.signal_errors.inc()
            self.failures.warning(
                "signal_error", "signal read from Redis failed: %r: ranked without signals", exc
            )
        except asyncio.CancelledError:  # the caller left (the handler is cancelled): as at a timeout
            self._stop_waiting(read)
            raise
        fallback = fallback_ranking(shopper, request.query, request.candidates, products, s.reason_max_chars)

        ranked, llm_ms, model = fallback, None, None
        reason: DegradedReason | None = None
        # The replicas a call may go to: the routable ones, else drained ones that still answer
        # (``Fleet.servable``); counting only routable ones answered every request unavailable while
        # the client itself still served through a drained replica.
        servable = len(self.llm.fleet.servable())
        remaining = answer_by - time.perf_counter()
        if servable == 0:
            reason = "llm_unavailable"
            self.failures.warning(
                reason, "no model replica servable (of %d): answered the fallback", len(self.llm.endpoints)
            )
        elif self.llm.in_flight >= servable * s.llm_concurrency_per_replica:
            reason = "overloaded"
        elif remaining < max(self.model_time.current(time.monotonic()), _MIN_MODEL_S):
            reason = "deadline"  # it could not answer in time even at its fastest: not asked
        else:
            started = time.perf_counter()
            ranked, reason, model = await self._ask(request, shopper, products, fallback, remaining)
            llm_s = time.perf_counter() - started
            llm_ms = llm_s * 1000
            self.metrics.llm.observe(llm_s)
            if model is not None:
                self.model_time.observe(llm_s, time.monotonic())

        elapsed_ms = (time.perf_counter() - arrived) * 1000
        own_s = max(elapsed_ms - (llm_ms or 0.0), 0.0) / 1000
        self.admission.own.observe(own_s, time.monotonic())
        m = self.metrics
        m.elapsed.observe(elapsed_ms / 1000)
        m.overhead.observe(own_s)
        (m.degraded_answers if reason else m.llm_answers).inc()
        if reason:
            m.degraded.labels(reason).inc()
        return MatchAnswer(
            request.shopper_id,
            ranked,
            reason is not None,
            reason,
            model,
            None if llm_ms is None else round(llm_ms, 3),
            round(elapsed_ms, 3),
            deadline_ms,
            SignalsFound(shopper is not None, len(products)),
        )

    def _stop_waiting(self, read: asyncio.Future[Any]) -> None:
        """Leave ``read`` to finish in the background, its connection going back to the pool; past
        ``max_late_reads`` cancel it (its connection closed), so reads nobody waits for stay bounded."""
        if len(self._late_reads) < self.settings.max_late_reads:
            self._late_reads.add(read)
            read.add_done_callback(self._late_read_done)
        else:  # Redis stalls: cancelled, its connection closed (kept, they piled up without bound)
            read.cancel()

    def _late_read_done(self, read: asyncio.Future[Any]) -> None:
        self._late_reads.discard(read)
        if not read.cancelled():
            read.exception()  # retrieved: a late read's error was counted when the request gave up on it

    async def _ask(
        self,
        request: MatchRequest,
        shopper: ShopperProfile | None,
        products: dict[str, ProductProfile],
        fallback: list[Ranked],
        remaining_s: float,
    ) -> tuple[list[Ranked], DegradedReason | None, str | None]:
        s = self.settings
        messages = ranking_messages(shopper, request.query, request.candidates, products, s.llm_top_k)
        self.asking += 1
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
        except _UNAVAILABLE as exc:
            return fallback, self._failed("llm_unavailable", exc), None
        except InvalidAnswer as exc:
            return fallback, self._failed("invalid_answer", exc), None
        except LLMError as exc:
            return fallback, self._failed("llm_error", exc), None
        finally:
            self.asking -= 1
        try:
            return (
                parse_ranking(completion.text, fallback, s.reason_max_chars, s.llm_top_k),
                None,
                completion.model,
            )
        except InvalidAnswer as exc:
            return fallback, self._failed("invalid_answer", exc), completion.model

    def _failed(self, reason: DegradedReason, error: LLMError) -> DegradedReason:
        """``reason``, logged with ``error`` (throttled)."""
        self.failures.warning(
            reason, "model call failed: %s: %s: answered the fallback", type(error).__name__, error
        )
        return reason
