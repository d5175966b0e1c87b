"""One attempt of a parsed call (``LLMClient.chat`` and ``request``) on one replica.

The request is POSTed as JSON; the answer is read within ``AnswerLimits`` and decoded into a
``Completion`` (``llm_client.answers``), then checked by the caller's ``validate``. While the attempt runs
the replica carries its load (outstanding requests, prefill tokens until the first streamed token,
decode tokens); however the attempt ends the load is given back and the fleet told how it ended
(``Fleet.succeeded``, ``failed`` or ``bad_answer``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from llm_client.answer_probes import AnswerProber, ProbeRequest
from llm_client.answers import AnswerValidator, parse_body, read_body, read_stream, validated
from llm_client.config import ClientConfig
from llm_client.cut_calls import CutCalls
from llm_client.endpoints import Endpoint
from llm_client.errors import InvalidAnswer, LLMError, Withdrawn
from llm_client.fleet import Fleet
from llm_client.gateway_headers import SERVED_BY_HEADER, fleet_size
from llm_client.models import Completion
from llm_client.routing import RouteOutcome, RouteRequest
from llm_client.routing.base import prefill_observer
from llm_client.status import raise_for_status
from llm_client.transport import SessionSource, header_value, mapped_transport_errors


class Exchange:
    def __init__(
        self,
        config: ClientConfig,
        fleet: Fleet,
        session: SessionSource,
        prober: AnswerProber,
        cut_calls: CutCalls | None = None,
    ) -> None:
        self.config = config
        self.cut_calls = cut_calls or CutCalls(config.timeouts.cut_grace_s)
        """Where an attempt its caller stopped waiting for reads on (``llm_client.cut_calls``)."""
        self.fleet = fleet
        self._session = session
        self.prober = prober
        # The same for every attempt (the settings do not change while the client runs): built once.
        self._timeout = aiohttp.ClientTimeout(
            total=config.timeouts.attempt_s, sock_connect=config.timeouts.connect_s
        )

    async def completion(
        self,
        endpoint: Endpoint,
        path: str,
        body: dict[str, Any],
        route: RouteRequest,
        validate: AnswerValidator | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        read_on_cut: bool = True,
    ) -> Completion:
        """``headers``: extra request headers (``Idempotency-Key`` from ``LLMClient.chat``);
        ``read_on_cut``: cut by its caller, the attempt may read on within ``cut_calls``' grace."""
        if endpoint.cut_off:
            raise Withdrawn("the replica left the fleet before the call reached it", endpoint=endpoint.name)
        session = self._session()
        policy = self.fleet.policy_of(endpoint)
        uncached = policy.estimate_uncached_tokens(route, endpoint)
        prefill_pending = [uncached]  # prefill work not yet done: cleared at the first streamed token
        report = self.fleet.prefill_reporter(route, endpoint)

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
        sent = {**(headers or {}), "x-session-id": header_value(route.key)}
        sent["Content-Type"] = "application/json"
        task = asyncio.current_task()
        assert task is not None
        endpoint.attempts[task] = task.cancelling()
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                completion, served_by = await self.cut_calls.run(
                    self._exchanged(session, endpoint, path, body, sent, started, prefill_done),
                    read_on=read_on_cut,
                    on_late=functools.partial(self._answered_late, endpoint, route, body, validate),
                    closing=endpoint.withdrawn,
                )
            if served_by is not None:  # through a gateway: the replica behind it that answered
                completion = replace(completion, endpoint=served_by)
            if validate is not None:
                completion = replace(completion, parsed=validated(validate, completion, endpoint.name))
            answered = True
        except InvalidAnswer as exc:
            self.fleet.bad_answer(endpoint, route, exc)
            self.prober.answered_badly(endpoint, ProbeRequest(path, body, validate))
            raise
        except LLMError as exc:
            # A slow connect or read on a busy replica is not a dead replica: it counts towards the
            # consecutive-failure limit; a failed connection ejects at once; a 429 counts for nothing.
            self.fleet.attempt_failed(endpoint, route, exc)
            raise
        except asyncio.CancelledError:
            # The caller's deadline, or the fleet withdrawing the replica: it did nothing wrong, nothing
            # is learned. A withdrawal alone (no other cancel pending since the attempt began, as
            # asyncio.timeout tells its own apart) moves the call on.
            if task in endpoint.withdrawn and task.uncancel() <= endpoint.attempts[task]:
                raise Withdrawn(
                    "the replica left the fleet during the call", endpoint=endpoint.name
                ) from None
            raise
        finally:
            del endpoint.attempts[task]
            if endpoint.withdrawn:
                endpoint.withdrawn.discard(task)
            endpoint.outstanding -= 1
            prefill_done(computed=answered)  # a no-op for the policy if the first token was reported
            endpoint.outstanding_decode_tokens -= route.max_tokens
            if (observer := prefill_observer(policy)) is not None:
                observer.attempt_over(route, endpoint)
        self.fleet.succeeded(endpoint, route, _outcome(completion, body))
        self.prober.answered_well(endpoint, ProbeRequest(path, body, validate))
        return completion

    def _answered_late(
        self,
        endpoint: Endpoint,
        route: RouteRequest,
        body: dict[str, Any],
        validate: AnswerValidator | None,
        exchanged: tuple[Completion, str | None],
    ) -> None:
        """An attempt cut by its caller's deadline that answered within the grace (``cut_calls``): its
        latency, the whole of it, is taught to the fleet as an answered call's is. Only a usable answer:
        one the caller's ``validate`` refuses teaches nothing, since nobody was served it."""
        completion = exchanged[0]
        if validate is not None:
            try:
                validated(validate, completion, endpoint.name)
            except InvalidAnswer:
                return
        self.fleet.succeeded(endpoint, route, _outcome(completion, body))

    async def _exchanged(
        self,
        session: aiohttp.ClientSession,
        endpoint: Endpoint,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        started: float,
        prefill_done: Callable[[], None],
    ) -> tuple[Completion, str | None]:
        """The HTTP exchange: the answer and, through a gateway, the replica that served it. Read to
        its end, so its connection goes back to the pool (``cut_calls`` may finish it after a cut)."""
        limits = self.config.answer_limits
        # bytes straight from orjson: ``json=`` would decode them to str and aiohttp encode them
        async with session.post(
            endpoint.url + path, data=orjson.dumps(body), headers=headers, timeout=self._timeout
        ) as response:
            if response.status >= 400:
                await raise_for_status(response, endpoint)
            served_by = response.headers.get(SERVED_BY_HEADER)
            if (behind := fleet_size(response.headers)) is not None:
                endpoint.replicas_behind = behind
            if body.get("stream"):
                completion = await read_stream(response, limits, endpoint.name, started, prefill_done)
            else:
                completion = parse_body(
                    await read_body(response, limits, endpoint.name), endpoint.name, started
                )
        return completion, served_by


def _outcome(completion: Completion, body: dict[str, Any]) -> RouteOutcome:
    return RouteOutcome(
        ok=True,
        prompt_tokens=completion.prompt_tokens,
        cached_tokens=completion.cached_tokens,
        latency_ms=completion.latency_ms,
        ttft_ms=completion.ttft_ms,
        completion_tokens=completion.completion_tokens,
        first_token=bool(body.get("stream")),
    )
