"""The P/D hand-over: a prompt prefilled on a context server and decoded on a generation server.

With a ``PdAwarePolicy`` and context servers, an attempt on a generation (decode) server may be two
steps (TensorRT-LLM's disaggregated protocol): ``context_only`` on the context server the policy picks
(prefill and first token, not streamed), then ``generation_only`` on the decode server with that
server's ``disaggregated_params``. A context step that fails, or blocks gone by the pull
(``kv_cache_gone``: timed out, restarted), means a local prefill on the decode server instead: the
request is never failed for it, and the decode server is not blamed. The context server is: its step
teaches the fleet as any attempt does (latency per unit of prefill work, failures), and blocks gone at
the pull count as its failure (``Fleet.blocks_gone``), so the degradation detector judges it against
its context peers and a drained one is no longer planned (only routable context servers are).

``disaggregated_params`` are the client's own: it writes them, and only from what a context server
answered it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson

from llm_client.answers import AnswerValidator
from llm_client.endpoints import Endpoint
from llm_client.errors import ConnectionFailed, KvCacheGone, LLMError
from llm_client.exchange import Exchange
from llm_client.fleet import Fleet
from llm_client.forwarding import Forwarder
from llm_client.models import Completion
from llm_client.passthrough import Forwarded
from llm_client.routing import RouteRequest
from llm_client.routing.base import prefill_observer
from llm_client.routing.pd_aware import PdAwarePolicy
from llm_client.status import ERROR_BODY_MAX_BYTES, KV_CACHE_GONE, KV_GONE_STATUSES
from llm_client.transport import mapped_transport_errors


class PdHandover:
    def __init__(self, fleet: Fleet, exchange: Exchange, forwarder: Forwarder) -> None:
        self.fleet = fleet
        self.exchange = exchange
        self.forwarder = forwarder

    def _plan(
        self, decode: Endpoint, route: RouteRequest
    ) -> tuple[PdAwarePolicy, Endpoint, RouteRequest] | None:
        policy = self.fleet.policy
        if not isinstance(policy, PdAwarePolicy) or not self.fleet.context_endpoints:
            return None
        routable = [c for c in self.fleet.context_endpoints if c.routable]
        plan = policy.context_for(route, decode, routable)
        return None if plan is None else (policy, *plan)

    def _decode_never_sent(self, decode: Endpoint, route: RouteRequest) -> None:
        """The call ended during its context step (cancelled: a newer version of its session, its
        caller gone, its deadline), before any attempt on ``decode``: what choosing ``decode`` booked
        there for this call is given back, as the end of an attempt gives it back. It stayed booked for
        good: the shopper counted in flight on that replica (its cache hits ignored, the hot-key spread
        pushing it off its cached replica) and the prompt held in the queued-prefill record."""
        observer = prefill_observer(self.fleet.policy_of(decode))
        if observer is not None:
            observer.prefill_abandoned(route, decode)
            observer.attempt_over(route, decode)

    # ---- parsed calls (``LLMClient.chat``) -----------------------------------------------------------
    async def completion(
        self,
        decode: Endpoint,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        validate: AnswerValidator | None,
        headers: Mapping[str, str] | None = None,
    ) -> Completion:
        """One attempt on ``decode``, in two steps when the policy sends the prefill elsewhere.
        ``headers`` go with the decode request only: an ``Idempotency-Key`` on the context step would
        let a gateway answer the whole call with the one-token prefill."""
        plan = self._plan(decode, route)
        if plan is None:  # no P/D, or the policy prefills this one where it is decoded
            return await self.exchange.completion(decode, path, body, route, validate, headers)
        started = time.perf_counter()
        generate_body = await self._prefilled(decode, route, plan, path, body)
        if generate_body is not None:
            try:
                answer = await self.exchange.completion(decode, path, generate_body, route, validate, headers)
            except KvCacheGone:
                plan[0].redone_locally()
                self.fleet.blocks_gone(plan[1])
            else:
                return timed_from(started, answer)
        answer = await self.exchange.completion(decode, path, body, route, validate, headers)
        return timed_from(started, answer)

    # ---- pass-through (``LLMClient.forward``) --------------------------------------------------------
    async def forwarded(
        self,
        decode: Endpoint,
        method: str,
        path: str,
        body: bytes | None,
        route: RouteRequest,
        headers: Mapping[str, str],
    ) -> Forwarded:
        """One pass-through attempt on ``decode``: the hand-over when the policy plans one and the
        decode server takes it, else the caller's own request, forwarded unchanged."""
        step = await self._context_step(decode, path, body, route)
        if step is not None:
            context, generation = step
            handed_over = await self._generation_step(
                decode, context, method, path, generation, route, headers
            )
            if handed_over is not None:
                return handed_over
        return await self.forwarder.attempt(decode, method, path, body, route, headers)

    async def _context_step(
        self, decode: Endpoint, path: str, body: bytes | None, route: RouteRequest
    ) -> tuple[Endpoint, bytes] | None:
        """When the policy sends this request's prefill to a context server, run ``context_only`` there
        and return that server and the body of the ``generation_only`` request for ``decode``; None to
        forward ``body`` unchanged (no P/D, a local prefill, or a context step that failed: never the
        caller's failure)."""
        if body is None:
            return None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # the replica answers a body it cannot read with its own 400
        if not isinstance(parsed, dict):
            return None
        # Read before planning: choosing the context server books it (in flight, a queued prefill, the
        # blocks it will hold), and only the context step gives that back.
        plan = self._plan(decode, route)
        if plan is None:
            return None
        generation = await self._prefilled(decode, route, plan, path, parsed)
        return None if generation is None else (plan[1], orjson.dumps(generation))

    async def _prefilled(
        self,
        decode: Endpoint,
        route: RouteRequest,
        plan: tuple[PdAwarePolicy, Endpoint, RouteRequest],
        path: str,
        body: dict[str, Any],
    ) -> dict[str, Any] | None:
        """The context step: ``body`` prefilled (``context_only``, one token, not streamed) on the
        plan's context server; returns the ``generation_only`` body for ``decode`` with that server's
        ``disaggregated_params``, or None (counted as redone locally) when the step failed. Ended
        otherwise (cancelled), it gives back what choosing ``decode`` booked."""
        policy, context, step = plan
        prefill_body = {
            **body,
            "stream": False,
            "max_tokens": 1,
            "disaggregated_params": {"request_type": "context_only"},
        }
        prefill_body.pop("stream_options", None)
        try:
            prefilled: Completion | None = await self.exchange.completion(
                context, path, prefill_body, step, read_on_cut=False
            )
        except LLMError:
            prefilled = None
        except BaseException:
            self._decode_never_sent(decode, route)
            raise
        params = None if prefilled is None else prefilled.disaggregated_params
        if params is None:
            policy.redone_locally()
            return None
        return {**body, "disaggregated_params": {**params, "request_type": "generation_only"}}

    async def _generation_step(
        self,
        endpoint: Endpoint,
        context: Endpoint,
        method: str,
        path: str,
        generation: bytes,
        route: RouteRequest,
        headers: Mapping[str, str],
    ) -> Forwarded | None:
        """The ``generation_only`` request; None when the decode server could not take the hand-over,
        and the caller's own request is then prefilled there instead: the context server's blocks were
        gone by the pull (``kv_cache_gone``, as a 503, 404 or 409: the decode server is not to blame),
        or it refused the hand-over with another 404/409 (the caller then sees the replica's own answer
        to its own request, byte for byte). Blocks gone count against ``context``, which held them."""
        try:
            forwarded = await self.forwarder.attempt(endpoint, method, path, generation, route, headers)
        except KvCacheGone:
            gone = True
        else:
            response = forwarded.response
            if response is None or response.status not in KV_GONE_STATUSES:
                return forwarded
            try:
                with mapped_transport_errors(endpoint.name, self.forwarder.config.timeouts.attempt_s):
                    detail = await response.content.read(ERROR_BODY_MAX_BYTES)
            except LLMError as exc:
                # The decode server broke off its own refusal: its failure, as any broken answer.
                self.fleet.failed(endpoint, route, connection=isinstance(exc, ConnectionFailed))
                raise
            finally:
                forwarded.release()  # whatever happened: the load it held there leaked for good
            gone = KV_CACHE_GONE.encode() in detail
        if gone:
            if isinstance(self.fleet.policy, PdAwarePolicy):
                self.fleet.policy.redone_locally()
            self.fleet.blocks_gone(context)
        return None


def timed_from(started: float, answer: Completion) -> Completion:
    """``answer`` (the decode server's step) timed from ``started`` (``time.perf_counter`` when the
    context step began), as its caller waited for it: its time to first token and latency include the
    context step, and any queue there. Timed from the decode step alone, a P/D call looked a prefill
    faster than it was, and an admission limit that watches the time to first token
    (``pipeline.admission_limit``) never saw the context servers queue."""
    before_ms = max(0.0, (time.perf_counter() - started) * 1000.0 - answer.latency_ms)
    return replace(answer, ttft_ms=answer.ttft_ms + before_ms, latency_ms=answer.latency_ms + before_ms)
