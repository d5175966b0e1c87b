"""The async LLM client.

Guarantees:
- at most ``max_in_flight`` requests are in flight; further callers wait (backpressure, not errors);
- each request ends within its deadline (the wait for a concurrency slot included), with a
  ``Completion`` or a typed ``LLMError`` (``llm_client.errors``): nothing else escapes, whatever a
  replica sends;
- an answer is untrusted input: read within ``AnswerLimits``, decoded into typed structs
  (``llm_client.answers``), and checked by the caller's ``validate``; an invalid one is tried once more
  on another replica, and a replica that keeps sending them is quarantined until a probe passes
  (``llm_client.answer_health``);
- a failed attempt is retried on a *different* replica when retryable, under the retry budget;
- a replica that refuses connections is ejected at once; the health checker re-admits it;
- the client is the only writer of ``Endpoint``: the policy and the degradation detector report what
  they learned (``Feedback``, ``HealthChange``) and the client records it;
- with a policy that follows KV cache events (``prefix_aware`` with ``kv_events="precise"``), the client
  polls every replica's ``POST /kv_cache_events`` (``llm_client.kv_events``) while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aiohttp
import orjson

from llm_client.answer_health import AnswerHealth
from llm_client.answers import parse_body, read_body, read_stream, usage_from_documents
from llm_client.config import ClientConfig
from llm_client.degradation import DegradationDetector, apply_health_changes
from llm_client.endpoints import Endpoint, endpoint_name
from llm_client.errors import (
    BadRequest,
    ConnectionFailed,
    DeadlineExceeded,
    EndpointUnavailable,
    InvalidAnswer,
    KvCacheGone,
    LLMError,
    NoHealthyEndpoint,
    RetryBudgetExhausted,
)
from llm_client.hooks import Attempt, ClientHooks
from llm_client.kv_events import KvEventPoller
from llm_client.models import Completion
from llm_client.passthrough import Forwarded
from llm_client.retry import RetryBudget, backoff_s
from llm_client.routing import RouteOutcome, RouteRequest, RoutingPolicy, make_policy
from llm_client.routing.base import KvEventConsumer, PrefillObserver
from llm_client.routing.pd_aware import PdAwarePolicy
from llm_client.transport import auth_headers, header_value, mapped_transport_errors, tls_context
from prompt_assembly.tokens import messages_text

log = logging.getLogger(__name__)

T = TypeVar("T")
AnswerValidator = Callable[[str], object]
"""Checks an answer's text and returns what the caller wants of it (kept as ``Completion.parsed``);
raises ``InvalidAnswer`` (kind ``schema``) when the text is not what the caller's schema requires."""


ERROR_BODY_MAX_BYTES = 4096
KV_CACHE_GONE = "kv_cache_gone"
"""The error type a generation server answers when it could not pull the context server's blocks."""

KV_GONE_STATUSES = frozenset({404, 409})
"""A ``generation_only`` request answered with these: the context server's blocks were not there to pull
(released after the transfer timeout, or the server restarted); the request is prefilled locally."""


class LLMClient:
    def __init__(
        self,
        config: ClientConfig,
        policy: RoutingPolicy | None = None,
        *,
        seed: int = 0,
        degradation: DegradationDetector | None = None,
        hooks: ClientHooks | None = None,
    ) -> None:
        self.config = config
        self.policy = policy or make_policy(config.routing())
        self.hooks = hooks or ClientHooks()
        """Attempt started / failed / finished callbacks (``llm_client.hooks``)."""
        # Drains replicas that are slow or erroring compared with their peers (see its settings).
        self.degradation = degradation or DegradationDetector()
        # Quarantines replicas whose answers keep failing validation (see its settings).
        self.answer_health = AnswerHealth(config.answer_health)
        self._probe_requests: dict[str, _ProbeRequest] = {}
        """Per quarantined replica, the request it last answered badly: its probe sends it again."""
        self.endpoints = [Endpoint(url.rstrip("/"), endpoint_name(url)) for url in config.endpoints]
        self.context_endpoints = [
            Endpoint(url.rstrip("/"), endpoint_name(url)) for url in config.context_endpoints
        ]
        """P/D disaggregation's context (prefill) servers; ``endpoints`` are then the generation servers
        (``llm_client.routing.pd_aware``). Empty: every replica serves whole requests."""
        self._gate = asyncio.Semaphore(config.max_in_flight)
        self._budget = RetryBudget(config.retry)
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.kv_events: KvEventPoller | None = None
        """Polls the replicas' KV cache events when the policy follows them (else None)."""
        self.context_kv_events: KvEventPoller | None = None
        """The same for P/D context servers, when the policy's context part follows them."""
        self.in_flight = 0
        self.retries = 0

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> LLMClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            security = self.config.security  # API key and CA bundle: llm_client.transport
            connector = aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=300, keepalive_timeout=60, ssl=tls_context(security)
            )
            self._session = aiohttp.ClientSession(
                connector=connector, json_serialize=_dumps, headers=auth_headers(security)
            )
            self._health_task = asyncio.create_task(self._health_loop(), name="llm-health")
            if isinstance(self.policy, KvEventConsumer) and self.policy.kv_event_poll_s is not None:
                self.kv_events = KvEventPoller(
                    self._session, lambda: self.endpoints, self.policy, self.policy.kv_event_poll_s
                )
                self.kv_events.start()
            context = self.policy.context if isinstance(self.policy, PdAwarePolicy) else None
            if context is not None and self.context_endpoints and context.kv_event_poll_s is not None:
                self.context_kv_events = KvEventPoller(
                    self._session, lambda: self.context_endpoints, context, context.kv_event_poll_s
                )
                self.context_kv_events.start()

    async def close(self) -> None:
        for poller in (self.kv_events, self.context_kv_events):
            if poller is not None:
                await poller.stop()
        self.kv_events = self.context_kv_events = None
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_endpoints(self, urls: Sequence[str]) -> None:
        """Route to exactly ``urls`` from now on (capacity shifting moves replicas between pools).
        Kept replicas keep their state (health, load, cache knowledge); new ones start fresh; dropped
        ones are forgotten by the routing policy. Calls in flight on a dropped replica finish normally."""
        wanted = [u.rstrip("/") for u in urls]
        current = {e.url: e for e in self.endpoints}
        for url, endpoint in current.items():
            if url not in wanted:
                self.policy.forget(endpoint)
                self.answer_health.forget(endpoint)
                self._probe_requests.pop(endpoint.name, None)
        self.endpoints = [current.get(url) or Endpoint(url, endpoint_name(url)) for url in wanted]

    # ---- calls ---------------------------------------------------------------------------------
    async def chat(
        self,
        messages: Sequence[dict[str, str]],
        *,
        routing_key: str,
        max_tokens: int = 200,
        response_format: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        temperature: float = 0.0,
        extra_body: dict[str, Any] | None = None,
        prompt_tokens: int | None = None,
        validate: AnswerValidator | None = None,
    ) -> Completion:
        """One chat completion, routed by ``routing_key`` (the shopper id). ``prompt_tokens``: the
        caller's estimate, used for load accounting (default: about 4 characters a token).
        ``validate``: the caller's check of the answer's text (its result is ``Completion.parsed``); an
        answer it rejects is tried once more on another replica and counts against the replica."""
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": self.config.stream,
        }
        if self.config.stream:
            body["stream_options"] = {"include_usage": True}
        if response_format is not None:
            body["response_format"] = response_format
        if self.config.cache_salt is not None:
            body["cache_salt"] = self.config.cache_salt
        if extra_body:
            body.update(extra_body)
        text = messages_text(messages)
        estimate = prompt_tokens if prompt_tokens is not None else len(text) // 4
        route = RouteRequest(routing_key, text, estimate, max_tokens)
        return await self.request(
            "/v1/chat/completions", body, route, deadline_s=deadline_s, validate=validate
        )

    async def request(
        self,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        *,
        deadline_s: float | None = None,
        validate: AnswerValidator | None = None,
    ) -> Completion:
        tried: list[str] = []
        async with self._call(deadline_s, tried):

            async def attempt(endpoint: Endpoint, number: int) -> Completion:
                info = Attempt(endpoint.name, route.key, number)
                self.hooks.started(info)
                try:
                    completion = await self._disaggregated(endpoint, path, body, route, validate)
                except LLMError as exc:
                    self.hooks.failed(info, exc)
                    raise
                completion = _with_attempts(completion, number)
                self.hooks.finished(info, completion)
                return completion

            return await self._retried(route, tried, attempt)

    async def _disaggregated(
        self,
        decode: Endpoint,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        validate: AnswerValidator | None,
    ) -> Completion:
        """One attempt on ``decode``; with P/D (a ``PdAwarePolicy`` and context servers) perhaps in two
        steps: ``context_only`` on the context server the policy picks (prefill and first token, not
        streamed), then ``generation_only`` on ``decode`` with that server's ``disaggregated_params``.
        A context step that fails, or blocks gone by the pull (``KvCacheGone``: timed out, restarted),
        means a local prefill on ``decode`` instead: the request is never failed for it."""
        policy = self.policy
        if not isinstance(policy, PdAwarePolicy) or not self.context_endpoints:
            return await self._attempt(decode, path, body, route, validate)
        plan = policy.context_for(route, decode, [c for c in self.context_endpoints if c.routable])
        if plan is not None:
            context, step = plan
            prefill_body = {
                **body,
                "stream": False,
                "max_tokens": 1,
                "disaggregated_params": {"request_type": "context_only"},
            }
            prefill_body.pop("stream_options", None)
            try:
                prefilled = await self._attempt(context, path, prefill_body, step)
            except LLMError:
                prefilled = None
            params = None if prefilled is None else prefilled.disaggregated_params
            if params is not None:
                generate_body = {
                    **body,
                    "disaggregated_params": {**params, "request_type": "generation_only"},
                }
                try:
                    return await self._attempt(decode, path, generate_body, route, validate)
                except KvCacheGone:
                    pass
            policy.redone_locally()
        return await self._attempt(decode, path, body, route, validate)

    @contextlib.asynccontextmanager
    async def _call(self, deadline_s: float | None, tried: list[str]) -> AsyncIterator[None]:
        """One call, however many attempts: the deadline over the whole block (the wait for a slot
        included: a caller's deadline holds however long the queue), the backpressure gate, the
        in-flight count, and the attempt count (``len(tried)``) on whatever error leaves it."""
        deadline = deadline_s if deadline_s is not None else self.config.timeouts.deadline_s
        try:
            async with asyncio.timeout(deadline), self._gate:
                self.in_flight += 1
                try:
                    yield
                finally:
                    self.in_flight -= 1
        except TimeoutError:
            error = DeadlineExceeded(f"no answer within the {deadline:.3f} s deadline")
            error.attempts = len(tried)
            raise error from None
        except LLMError as exc:
            exc.attempts = len(tried)
            raise

    async def _retried(
        self,
        route: RouteRequest,
        tried: list[str],
        attempt: Callable[[Endpoint, int], Awaitable[T]],
    ) -> T:
        """Attempts in order, each ``attempt(endpoint, number)`` on the replica the policy picks;
        ``tried`` collects the replica of each (its length is the attempt count; a retry goes back to a
        replica already tried only when no other is routable). A retryable error is retried under the
        retry budget with backoff; any other is raised at once. An invalid answer is tried once more,
        not again: two replicas answering one prompt badly say more about the prompt than the fleet."""
        self._budget.on_request()
        last_error: LLMError | None = None
        for number in range(1, self.config.retry.max_attempts + 1):
            if isinstance(last_error, InvalidAnswer) and number > 2:
                raise last_error
            if number > 1:
                if not self._budget.try_spend():
                    raise RetryBudgetExhausted(f"retry budget exhausted after: {last_error}")
                self.retries += 1
                await asyncio.sleep(backoff_s(number - 2, self.config.retry, self._rng))
            if not any(e.routable for e in self.endpoints):
                await self._wait_for_routable()
            endpoint = self._choose(route, tried)
            tried.append(endpoint.name)
            try:
                return await attempt(endpoint, number)
            except LLMError as exc:
                if not exc.retryable:
                    raise
                last_error = exc
        assert last_error is not None
        raise last_error

    def _choose(self, route: RouteRequest, tried: list[str]) -> Endpoint:
        candidates = [e for e in self.endpoints if e.routable and e.name not in tried]
        if not candidates:
            candidates = [e for e in self.endpoints if e.routable]
        if not candidates:
            raise NoHealthyEndpoint(f"all {len(self.endpoints)} replicas are ejected or drained")
        return self.policy.choose(route, candidates)

    def _policy_of(self, endpoint: Endpoint) -> RoutingPolicy:
        """The policy that routes to ``endpoint``: a P/D policy's context part for a context server."""
        if isinstance(self.policy, PdAwarePolicy) and any(endpoint is c for c in self.context_endpoints):
            return self.policy.context
        return self.policy

    def _prefill_reporter(self, route: RouteRequest, endpoint: Endpoint) -> Callable[[bool], None] | None:
        """How an attempt tells a ``PrefillObserver`` policy its prefill is over: computed (a first token
        came) or abandoned (it ended without one); None for a policy that does not listen."""
        policy = self._policy_of(endpoint)
        observer = policy if isinstance(policy, PrefillObserver) else None
        if observer is None:
            return None

        def report(computed: bool) -> None:
            if computed:
                observer.prefill_done(route, endpoint)
            else:
                observer.prefill_abandoned(route, endpoint)

        return report

    async def _attempt(
        self,
        endpoint: Endpoint,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        validate: AnswerValidator | None = None,
    ) -> Completion:
        assert self._session is not None, "call start() or use 'async with' first"
        policy = self._policy_of(endpoint)
        uncached = policy.estimate_uncached_tokens(route, endpoint)
        prefill_pending = [uncached]  # prefill work not yet done: cleared at the first streamed token
        report = self._prefill_reporter(route, endpoint)

        def prefill_done(computed: bool = True) -> None:
            endpoint.outstanding_prefill_tokens -= prefill_pending[0]
            prefill_pending[0] = 0
            if report is not None:
                report(computed)

        answered = False
        endpoint.outstanding += 1
        endpoint.outstanding_prefill_tokens += uncached
        endpoint.outstanding_decode_tokens += route.max_tokens
        started = time.perf_counter()
        timeout = aiohttp.ClientTimeout(
            total=self.config.timeouts.attempt_s, sock_connect=self.config.timeouts.connect_s
        )
        headers = {"x-session-id": header_value(route.key), "Content-Type": "application/json"}
        limits = self.config.answer_limits
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                # bytes straight from orjson: ``json=`` would decode them to str and aiohttp encode them
                async with self._session.post(
                    endpoint.url + path, data=orjson.dumps(body), headers=headers, timeout=timeout
                ) as response:
                    if response.status >= 400:
                        await self._raise_for_status(response, endpoint)
                    if body.get("stream"):
                        completion = await read_stream(response, limits, endpoint.name, started, prefill_done)
                    else:
                        completion = parse_body(
                            await read_body(response, limits, endpoint.name), endpoint.name, started
                        )
            if validate is not None:
                completion = replace(completion, parsed=_validated(validate, completion, endpoint.name))
            answered = True
        except InvalidAnswer as exc:
            # the probe replays the request whole and not streamed (a P/D hand-over cannot be replayed)
            probe_body = {
                k: v for k, v in body.items() if k not in ("disaggregated_params", "stream_options")
            }
            self._bad_answer(
                endpoint, route, exc, _ProbeRequest(path, {**probe_body, "stream": False}, validate)
            )
            raise
        except LLMError as exc:
            # A slow connect or read on a busy replica is not a dead replica: it counts towards the
            # consecutive-failure limit; a failed connection ejects at once.
            if exc.retryable:
                self._fail(endpoint, route, connection=isinstance(exc, ConnectionFailed))
            raise
        except asyncio.CancelledError:
            # The caller's deadline: the replica did nothing wrong, nothing is learned.
            raise
        finally:
            endpoint.outstanding -= 1
            prefill_done(computed=answered)  # a no-op for the policy if the first token was reported
            endpoint.outstanding_decode_tokens -= route.max_tokens
            if isinstance(policy, PrefillObserver):
                policy.attempt_over(route, endpoint)
        self.answer_health.observe(endpoint, self._peers(endpoint), None)
        endpoint.record_success(completion.latency_ms, completion.ttft_ms)
        self.degradation.observe_success(
            endpoint,
            completion.latency_ms,
            prompt_tokens=completion.prompt_tokens,
            cached_tokens=completion.cached_tokens,
            completion_tokens=completion.completion_tokens,
        )
        self._evaluate_health()
        self._observe(
            route,
            endpoint,
            RouteOutcome(
                ok=True,
                prompt_tokens=completion.prompt_tokens,
                cached_tokens=completion.cached_tokens,
                latency_ms=completion.latency_ms,
                ttft_ms=completion.ttft_ms,
            ),
        )
        return completion

    async def _raise_for_status(self, response: aiohttp.ClientResponse, endpoint: Endpoint) -> None:
        # at most 4 KiB of an error body, 300 characters of it in the error: a replica's error page is
        # as untrusted as its answers. The error's type can follow a long message (a KV pull's
        # connection error), so the whole bounded body is searched for it.
        body = (await response.content.read(ERROR_BODY_MAX_BYTES)).decode("utf-8", "replace")
        detail = body[:300]
        if response.status in (404, 409, 503) and KV_CACHE_GONE in body:
            raise KvCacheGone(f"HTTP {response.status}: {detail}", endpoint=endpoint.name)
        if response.status == 429 or response.status >= 500:
            raise EndpointUnavailable(f"HTTP {response.status}: {detail}", endpoint=endpoint.name)
        raise BadRequest(f"HTTP {response.status}: {detail}", endpoint=endpoint.name)

    def _fail(self, endpoint: Endpoint, route: RouteRequest, *, connection: bool) -> None:
        endpoint.record_failure()
        self._observe(route, endpoint, RouteOutcome(ok=False, connection_failed=connection))
        self.degradation.observe_failure(endpoint)
        self._evaluate_health()
        limit = self.config.health.eject_after_failures
        if endpoint.healthy and (connection or endpoint.consecutive_failures >= limit):
            self.eject(
                endpoint,
                "connection failed" if connection else f"{endpoint.consecutive_failures} failures in a row",
            )

    def _bad_answer(
        self,
        endpoint: Endpoint,
        route: RouteRequest,
        error: InvalidAnswer,
        request: _ProbeRequest | None = None,
    ) -> None:
        """An answer that is no answer: counted by kind, taught to the policy (the replica holds nothing
        known for this prompt), and judged by the answer health, which may quarantine the replica.
        ``request`` (the call that got it, if the client built it) becomes the replica's probe."""
        endpoint.failed += 1
        endpoint.invalid_answers[error.kind] = endpoint.invalid_answers.get(error.kind, 0) + 1
        self._observe(route, endpoint, RouteOutcome(ok=False))
        self.degradation.observe_failure(endpoint)
        quarantine = self.answer_health.observe(endpoint, self._peers(endpoint), error.kind, str(error))
        if quarantine is not None:
            endpoint.quarantined = True
            endpoint.quarantine_kind = quarantine.reason
            endpoint.out_reason = f"bad answers ({quarantine.reason}): {quarantine.detail}"
            self._policy_of(endpoint).forget(endpoint)
        if request is not None and endpoint.quarantined:
            self._probe_requests[endpoint.name] = request

    def _peers(self, endpoint: Endpoint) -> list[Endpoint]:
        """The pool ``endpoint`` belongs to (context servers, or the others)."""
        contexts = self.context_endpoints
        return contexts if any(endpoint is c for c in contexts) else self.endpoints

    def _observe(self, route: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
        """Teach the policy, and record on the replica what it learned."""
        if self._policy_of(endpoint).observe(route, endpoint, outcome).restart_detected:
            endpoint.restarts_detected += 1

    def _evaluate_health(self) -> None:
        """Let the degradation detector judge the replicas, and apply its drains and re-admissions."""
        apply_health_changes(self.endpoints, self.degradation.evaluate(self.endpoints))

    async def _wait_for_routable(self) -> None:
        """Every replica is ejected: wait (within the caller's deadline) for the health checker to
        re-admit one, instead of failing every request of a short outage."""
        while not any(e.routable for e in self.endpoints):
            await asyncio.sleep(self.config.health.interval_s / 2)

    # ---- raw pass-through, for the routing gateway (gateway/) -----------------------------------
    @contextlib.asynccontextmanager
    async def forward(
        self,
        path: str,
        body: bytes | None,
        route: RouteRequest,
        *,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> AsyncIterator[Forwarded]:
        """Send ``body`` unchanged to the replica the policy picks for ``route`` and yield its answer
        unread, for a proxy to pass on byte for byte (``Forwarded.chunks``).

        Same routing, backpressure, retry budget, ejection and health as ``request``: a refused
        connection, a timeout, a 5xx or a 429 is retried on another replica; the first answer with any
        other status (2xx, or a 4xx the caller must see) is yielded. Retries happen only before the
        yield: once the caller holds the answer, a replica that breaks off raises from ``chunks`` (and
        is blamed), since bytes may already be on their way. The deadline covers the whole block. When
        the block exits the replica's load is given back; a body read to its end teaches the policy and
        the degradation detector (usage and first-byte time read in passing), one the caller left
        unread teaches nothing."""
        tried: list[str] = []
        async with self._call(deadline_s, tried):

            async def attempt(endpoint: Endpoint, number: int) -> Forwarded:
                generation = await self._context_step(endpoint, path, body, route)
                if generation is not None:
                    handed_over = await self._generation_step(
                        endpoint, method, path, generation, route, headers
                    )
                    if handed_over is not None:
                        return handed_over
                return await self._forward_attempt(endpoint, method, path, body, route, headers or {})

            forwarded = await self._retried(route, tried, attempt)
            forwarded.attempts = len(tried)
            try:
                yield forwarded
            except InvalidAnswer as exc:  # from chunks(): over the size limit
                self._bad_answer(forwarded.endpoint, route, exc)
                raise
            except LLMError as exc:  # from chunks(): broke off or stalled
                self._fail(forwarded.endpoint, route, connection=isinstance(exc, ConnectionFailed))
                raise
            finally:
                forwarded.release()
            if forwarded.finished_ms is not None and forwarded.status < 400:
                self._forward_learn(forwarded, route)

    async def _context_step(
        self, decode: Endpoint, path: str, body: bytes | None, route: RouteRequest
    ) -> bytes | None:
        """``forward``'s P/D step, as ``_disaggregated`` makes it for ``chat``: when the policy sends
        this request's prefill to a context server, run ``context_only`` there and return the body of
        the ``generation_only`` request for ``decode``; None to forward ``body`` unchanged (no P/D, a
        local prefill, or a context step that failed: never the caller's failure)."""
        policy = self.policy
        if body is None or not isinstance(policy, PdAwarePolicy) or not self.context_endpoints:
            return None
        plan = policy.context_for(route, decode, [c for c in self.context_endpoints if c.routable])
        if plan is None:
            return None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # the replica answers a body it cannot read with its own 400
        if not isinstance(parsed, dict):
            return None
        context, step = plan
        prefill_body = {**parsed, "stream": False, "max_tokens": 1}
        prefill_body["disaggregated_params"] = {"request_type": "context_only"}
        prefill_body.pop("stream_options", None)
        try:
            prefilled = await self._attempt(context, path, prefill_body, step)
        except LLMError:
            prefilled = None
        params = None if prefilled is None else prefilled.disaggregated_params
        if params is None:
            policy.redone_locally()
            return None
        generation = {**parsed, "disaggregated_params": {**params, "request_type": "generation_only"}}
        return orjson.dumps(generation)

    async def _generation_step(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        generation: bytes,
        route: RouteRequest,
        headers: Mapping[str, str] | None,
    ) -> Forwarded | None:
        """``forward``'s ``generation_only`` request; None when the decode server could not take the
        hand-over, and the caller's own request is then prefilled there instead: the context server's
        blocks were gone by the pull (``kv_cache_gone``, as a 503, 404 or 409: the decode server is not
        to blame), or it refused the hand-over with another 404/409 (the caller then sees the
        replica's own answer to its own request, byte for byte)."""
        try:
            forwarded = await self._forward_attempt(endpoint, method, path, generation, route, headers or {})
        except KvCacheGone:
            gone = True
        else:
            response = forwarded.response
            if response is None or response.status not in KV_GONE_STATUSES:
                return forwarded
            detail = await response.content.read(ERROR_BODY_MAX_BYTES)  # released just below
            forwarded.release()
            gone = KV_CACHE_GONE.encode() in detail
        if gone and isinstance(self.policy, PdAwarePolicy):
            self.policy.redone_locally()
        return None

    async def _forward_attempt(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        body: bytes | None,
        route: RouteRequest,
        headers: Mapping[str, str],
    ) -> Forwarded:
        assert self._session is not None, "call start() or use 'async with' first"
        forwarded = Forwarded(
            endpoint,
            route.max_tokens,
            self.policy.estimate_uncached_tokens(route, endpoint),
            max_bytes=self.config.answer_limits.max_answer_bytes,
        )
        forwarded.on_prefill_done = self._prefill_reporter(route, endpoint)
        if isinstance(self.policy, PrefillObserver):
            observer = self.policy
            forwarded.on_release = lambda: observer.attempt_over(route, endpoint)
        forwarded.hold()
        timeout = aiohttp.ClientTimeout(
            total=self.config.timeouts.attempt_s, sock_connect=self.config.timeouts.connect_s
        )
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                forwarded.response = await self._session.request(
                    method,
                    endpoint.url + path,
                    data=body,
                    headers={**headers, "x-session-id": header_value(route.key)},
                    timeout=timeout,
                )
                if forwarded.response.status == 429 or forwarded.response.status >= 500:
                    await self._raise_for_status(forwarded.response, endpoint)
            return forwarded
        except InvalidAnswer as exc:
            self._bad_answer(endpoint, route, exc)  # before release: a failure is no first token
            forwarded.release()
            raise
        except LLMError as exc:
            if exc.retryable:  # as in _attempt: blocks gone at the pull are not the replica's failure
                self._fail(endpoint, route, connection=isinstance(exc, ConnectionFailed))  # before release
            forwarded.release()
            raise
        except BaseException:
            forwarded.release()
            raise

    def _forward_learn(self, forwarded: Forwarded, route: RouteRequest) -> None:
        endpoint, tap = forwarded.endpoint, forwarded.tap
        if tap.error is not None:  # an error event inside a 200 stream: the replica failed the request
            self._fail(endpoint, route, connection=False)
            return
        prompt, cached, completion_tokens = usage_from_documents(tap.usage, tap.timings)
        latency = forwarded.finished_ms or 0.0
        ttft = forwarded.first_byte_ms if tap.streaming and forwarded.first_byte_ms is not None else latency
        endpoint.record_success(latency, ttft)
        self.degradation.observe_success(
            endpoint, latency, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion_tokens
        )
        self._evaluate_health()
        self._observe(
            route,
            endpoint,
            RouteOutcome(
                ok=True, prompt_tokens=prompt, cached_tokens=cached, latency_ms=latency, ttft_ms=ttft
            ),
        )

    # ---- end of raw pass-through ------------------------------------------------------------------

    # ---- health --------------------------------------------------------------------------------
    def eject(self, endpoint: Endpoint, reason: str = "ejected") -> None:
        endpoint.healthy = False
        endpoint.ejections += 1
        endpoint.out_reason = reason
        log.warning("ejecting replica %s until /health answers: %s", endpoint.name, reason)
        self._policy_of(endpoint).forget(endpoint)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval_s)
            self._evaluate_health()
            await asyncio.gather(
                *(self._probe(e) for e in [*self.endpoints, *self.context_endpoints] if not e.healthy),
                *(
                    self._answer_probe(e)
                    for e in [*self.endpoints, *self.context_endpoints]
                    if e.healthy and e.quarantined and self.answer_health.probe_due(e)
                ),
            )

    async def _answer_probe(self, endpoint: Endpoint) -> None:
        """A quarantined replica comes back only by answering well: the request it last failed, sent
        again (not streamed) and checked by the same ``validate``, or, for a replica quarantined by the
        gateway's pass-through, a small completion that must come back well formed. ``/health`` alone
        says nothing about a replica's answers."""
        assert self._session is not None
        request = self._probe_requests.get(endpoint.name) or _ProbeRequest(
            "/v1/chat/completions",
            {
                "model": self.config.model,
                "messages": [{"role": "user", "content": "Reply with the word ok."}],
                "max_tokens": 4,
                "stream": False,
            },
            None,
        )
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.attempt_s)
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                async with self._session.post(
                    endpoint.url + request.path, data=orjson.dumps(request.body), timeout=timeout
                ) as response:
                    if response.status >= 400:
                        await self._raise_for_status(response, endpoint)
                    raw = await read_body(response, self.config.answer_limits, endpoint.name)
            completion = parse_body(raw, endpoint.name, time.perf_counter())
            if request.validate is not None:
                _validated(request.validate, completion, endpoint.name)
            elif not completion.text.strip():
                raise InvalidAnswer("probe answer is empty", kind="empty", endpoint=endpoint.name)
        except LLMError as exc:
            self.answer_health.probe_failed(endpoint, str(exc))
            return
        self.answer_health.probe_passed(endpoint)
        self._probe_requests.pop(endpoint.name, None)
        endpoint.quarantined = False

    async def _probe(self, endpoint: Endpoint) -> None:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s * 2)
            async with self._session.get(endpoint.url + "/health", timeout=timeout) as response:
                if response.status == 200:
                    endpoint.healthy = True
                    endpoint.consecutive_failures = 0
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            pass

    async def wait_until_healthy(self, timeout_s: float = 30.0) -> None:
        """Probe every replica once now (start-up helper for CLIs and tests)."""
        assert self._session is not None
        async with asyncio.timeout(timeout_s):
            while True:
                every = [*self.endpoints, *self.context_endpoints]
                for endpoint in every:
                    endpoint.healthy = False
                await asyncio.gather(*(self._probe(e) for e in every))
                if all(e.healthy for e in every):
                    return
                await asyncio.sleep(0.2)


@dataclass(frozen=True, slots=True)
class _ProbeRequest:
    path: str
    body: dict[str, Any]
    validate: AnswerValidator | None


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _with_attempts(completion: Completion, attempts: int) -> Completion:
    return completion if completion.attempts == attempts else replace(completion, attempts=attempts)


def _validated(validate: AnswerValidator, completion: Completion, endpoint: str) -> object:
    """The caller's verdict on an answer; its own ``ValueError``/``TypeError`` counts as a schema miss,
    so a validator written carelessly cannot crash the call."""
    try:
        return validate(completion.text)
    except InvalidAnswer as exc:
        exc.endpoint = exc.endpoint or endpoint
        exc.raw = completion.text[:2000] if exc.raw is None else exc.raw
        raise
    except (ValueError, TypeError) as exc:
        message = f"answer rejected by the caller's schema: {exc}"
        raise InvalidAnswer(message, kind="schema", endpoint=endpoint, raw=completion.text) from None
