"""The async LLM client: the one public object, composed of parts that each own one concern.

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
- the client is the only writer of ``Endpoint`` (``llm_client.fleet``): the policy and the degradation
  detector report what they learned (``Feedback``, ``HealthChange``) and the fleet records it;
- with a policy that follows KV cache events (``prefix_aware`` with ``kv_events="precise"``), the client
  polls every replica's ``POST /kv_cache_events`` (``llm_client.kv_events``) while it runs.

Where each concern lives, as httpx keeps its transports, pools and client apart:

- ``llm_client.fleet``: the replicas, and what each attempt's outcome teaches (policy, degradation,
  answer health, ejection, quarantine);
- ``llm_client.calls``: deadline, backpressure and the retry loop under the retry budget;
- ``llm_client.exchange``: one attempt of a parsed call; ``llm_client.forwarding``: one pass-through
  attempt; ``llm_client.pd_handover``: the P/D two-step for both;
- ``llm_client.health_checks``: the health loop; ``llm_client.answer_probes``: re-admission by probe.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from llm_client.answer_health import AnswerHealth
from llm_client.answer_probes import AnswerProber, ProbeRequest
from llm_client.answers import AnswerValidator
from llm_client.calls import Calls
from llm_client.config import ClientConfig
from llm_client.cut_calls import CutCalls
from llm_client.degradation import DegradationDetector
from llm_client.endpoints import Endpoint
from llm_client.errors import ConnectionFailed, InvalidAnswer, LLMError
from llm_client.exchange import Exchange
from llm_client.fleet import Fleet
from llm_client.forwarding import Forwarder
from llm_client.health_checks import HealthChecker
from llm_client.hooks import Attempt, ClientHooks
from llm_client.kv_events import KvEventPoller
from llm_client.models import Completion
from llm_client.passthrough import Forwarded
from llm_client.pd_handover import PdHandover
from llm_client.routing import RouteRequest, RoutingPolicy, make_policy
from llm_client.routing.base import KvEventConsumer
from llm_client.routing.pd_aware import PdAwarePolicy
from llm_client.transport import auth_headers, header_value, tls_context
from prompt_assembly.tokens import messages_text

log = logging.getLogger(__name__)

__all__ = ["IDEMPOTENCY_HEADER", "AnswerValidator", "LLMClient"]

IDEMPOTENCY_HEADER = "Idempotency-Key"
SESSION_VERSION_HEADER = "x-session-version"
"""With the routing key (sent as ``x-session-id`` on every call), the gateway's supersede header
(``gateway.supersede``): a newer version of the same session cancels or drops the older call there;
replicas ignore it."""
"""The header ``chat`` sends its ``idempotency_key`` in (IETF draft ``httpapi-idempotency-key-header``)."""


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
        self.hooks = hooks or ClientHooks()
        """Attempt started / failed / finished callbacks (``llm_client.hooks``)."""
        self.fleet = Fleet(
            config,
            policy or make_policy(config.routing()),
            # Drains replicas that are slow or erroring compared with their peers (see its settings).
            degradation or DegradationDetector(),
            # Quarantines replicas whose answers keep failing validation (see its settings).
            AnswerHealth(config.answer_health),
        )
        self._calls = Calls(config, self.fleet, seed=seed)
        self._session: aiohttp.ClientSession | None = None
        self._prober = AnswerProber(config, self.fleet, self._open_session)
        self._exchange = Exchange(config, self.fleet, self._open_session, self._prober)
        self._forwarder = Forwarder(config, self.fleet, self._open_session)
        self._handover = PdHandover(self.fleet, self._exchange, self._forwarder)
        self._health = HealthChecker(config, self.fleet, self._open_session, self._prober)
        self.kv_events: KvEventPoller | None = None
        """Polls the replicas' KV cache events when the policy follows them (else None)."""
        self.context_kv_events: KvEventPoller | None = None
        """The same for P/D context servers, when the policy's context part follows them."""

    # ---- what callers and /metrics read ----------------------------------------------------------
    @property
    def policy(self) -> RoutingPolicy:
        return self.fleet.policy

    @property
    def degradation(self) -> DegradationDetector:
        return self.fleet.degradation

    @property
    def answer_health(self) -> AnswerHealth:
        return self.fleet.answer_health

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.fleet.endpoints

    @property
    def context_endpoints(self) -> list[Endpoint]:
        """P/D disaggregation's context (prefill) servers; ``endpoints`` are then the generation servers
        (``llm_client.routing.pd_aware``). Empty: every replica serves whole requests."""
        return self.fleet.context_endpoints

    @property
    def in_flight(self) -> int:
        """Calls a replica is working on for this client: those a caller waits for, and those cut at
        their caller's deadline that read on within their grace (``cut_calls``), which still hold a
        replica's slot; load shedding (``realtime.matching``) and ``/metrics`` read it."""
        return self._calls.in_flight + self._exchange.cut_calls.reading

    @property
    def retries(self) -> int:
        return self._calls.retries

    @property
    def failovers(self) -> int:
        """Of ``retries``, those away from an invalid answer (``InvalidAnswer``): not a sign of load."""
        return self._calls.failovers

    @property
    def withdrawn(self) -> int:
        """Calls moved to another replica because theirs left the fleet (``set_endpoints``)."""
        return self._calls.withdrawn

    @property
    def cut_calls(self) -> CutCalls:
        """Attempts read on after their caller left (``timeouts.cut_grace_s``), and what became of them."""
        return self._exchange.cut_calls

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> LLMClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _open_session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "call start() or use 'async with' first"
        return self._session

    async def start(self) -> None:
        if self._session is not None:
            return
        security = self.config.security  # API key and CA bundle: llm_client.transport
        connector = aiohttp.TCPConnector(
            limit=0, ttl_dns_cache=300, keepalive_timeout=60, ssl=tls_context(security)
        )
        self._session = aiohttp.ClientSession(
            connector=connector, json_serialize=_dumps, headers=auth_headers(security)
        )
        self._health.start()
        policy = self.policy
        if isinstance(policy, KvEventConsumer) and policy.kv_event_poll_s is not None:
            self.kv_events = KvEventPoller(
                self._session, lambda: self.fleet.endpoints, policy, policy.kv_event_poll_s
            )
            self.kv_events.start()
        context = policy.context if isinstance(policy, PdAwarePolicy) else None
        if context is not None and self.context_endpoints and context.kv_event_poll_s is not None:
            self.context_kv_events = KvEventPoller(
                self._session, lambda: self.fleet.context_endpoints, context, context.kv_event_poll_s
            )
            self.context_kv_events.start()

    async def close(self) -> None:
        for poller in (self.kv_events, self.context_kv_events):
            if poller is not None:
                await poller.stop()
        self.kv_events = self.context_kv_events = None
        await self._health.stop()
        await self._exchange.cut_calls.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_endpoints(
        self, urls: Sequence[str], *, withdraw_after_s: float | Mapping[str, float] | None = None
    ) -> None:
        """Route to exactly ``urls`` from now on (capacity shifting moves replicas between pools).
        Kept replicas keep their state (health, load, cache knowledge); new ones start fresh; dropped
        ones are forgotten by the routing policy. Calls in flight on a dropped replica finish normally,
        or with ``withdraw_after_s`` (one time, or one per dropped URL), those still running that long
        from now are cut (their requests closed, which frees their slots on the replica) and moved to a
        kept replica (``withdrawn``)."""
        self.fleet.set_endpoints(urls, withdraw_after_s=withdraw_after_s)

    def eject(self, endpoint: Endpoint, reason: str = "ejected") -> None:
        self.fleet.eject(endpoint, reason)

    async def wait_until_healthy(self, timeout_s: float = 30.0, *, minimum: int | None = None) -> None:
        """Probe every replica now, until all answer, or ``minimum`` of them (start-up helper for CLIs
        and tests)."""
        self._open_session()
        await self._health.wait_until_healthy(timeout_s, minimum=minimum)

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
        idempotency_key: str | None = None,
        session_version: str | None = None,
    ) -> Completion:
        """One chat completion, routed by ``routing_key`` (the shopper id). ``prompt_tokens``: the
        caller's estimate, used for load accounting (default: about 4 characters a token).
        ``validate``: the caller's check of the answer's text (its result is ``Completion.parsed``); an
        answer it rejects is tried once more on another replica and counts against the replica.
        ``idempotency_key`` (a prompt's ``request_id``) is sent as ``Idempotency-Key``: behind
        ``shopper router serve`` a call with a key already in flight joins it, and one answered within
        the gateway's TTL is answered again without a call (docs/gateway.md); replicas ignore it.
        ``session_version`` (``EPOCH.SEQ``) is sent with the routing key as the session: behind the
        gateway a newer version cancels this session's older call, which a caller that left (a
        superseded prompt whose request it closed) would otherwise leave running under its key."""
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
        headers: dict[str, str] = {}
        if idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = header_value(idempotency_key)
        if session_version is not None:
            headers[SESSION_VERSION_HEADER] = header_value(session_version)
        return await self.request(
            "/v1/chat/completions",
            body,
            route,
            deadline_s=deadline_s,
            validate=validate,
            headers=headers or None,
        )

    async def request(
        self,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        *,
        deadline_s: float | None = None,
        validate: AnswerValidator | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Completion:
        """``headers``: extra request headers for the replica (or the gateway in front of it)."""
        tried: list[str] = []
        async with self._calls.call(deadline_s, tried) as expires_at:

            async def attempt(endpoint: Endpoint, number: int) -> Completion:
                # No hook registered (the real-time path): no record to build for nobody.
                info = Attempt(endpoint.name, route.key, number) if self.hooks.any else None
                if info is not None:
                    self.hooks.started(info)
                try:
                    completion = await self._handover.completion(
                        endpoint, path, body, route, validate, headers
                    )
                except LLMError as exc:
                    if info is not None:
                        self.hooks.failed(info, exc)
                    raise
                if completion.attempts != number:
                    completion = replace(completion, attempts=number)
                if info is not None:
                    self.hooks.finished(info, completion)
                return completion

            return await self._calls.retried(route, tried, attempt, expires_at)

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
        async with self._calls.call(deadline_s, tried) as expires_at:

            async def attempt(endpoint: Endpoint, number: int) -> Forwarded:
                return await self._handover.forwarded(endpoint, method, path, body, route, headers or {})

            forwarded = await self._calls.retried(route, tried, attempt, expires_at)
            forwarded.attempts = len(tried)
            try:
                yield forwarded
            except InvalidAnswer as exc:  # from chunks(): over the size limit
                self.fleet.bad_answer(forwarded.endpoint, route, exc)
                raise
            except LLMError as exc:  # from chunks(): broke off or stalled
                self.fleet.failed(forwarded.endpoint, route, connection=isinstance(exc, ConnectionFailed))
                raise
            finally:
                forwarded.release()
            if forwarded.finished_ms is not None and forwarded.status < 400:
                self._forwarder.learn(forwarded, route)
                if body is not None and forwarded.tap.error is None:
                    self._prober.answered_well(forwarded.endpoint, ProbeRequest(path, body, None))


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
