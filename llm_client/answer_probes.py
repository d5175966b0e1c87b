"""Answer probes: how a quarantined replica earns its way back (``llm_client.answer_health`` decides when).

``/health`` alone says nothing about a replica's answers, so a quarantined replica comes back only by
answering a real completion well, checked as a call's answer is checked.

The probe is a *known-good* request: the last one a replica of the same pool answered well (whole, not
streamed, with the caller's own model name and, for ``chat``, checked by the same ``validate``). Not
the request the replica failed: a quarantine caused by one poison prompt (a prompt no replica answers
within the caller's schema) never lifted when its probe was that prompt again. Not a made-up request
either, where a real one is known: a server that checks model names refused the made-up one's
``"model": "default"`` forever. Before any answer was good (a burst's first answers), the probe is the
request the replica last answered badly, with its check (a made-up request with no check would let a
replica that answers everything outside the caller's schema back at once), and only for a replica
quarantined by the gateway's pass-through, which checks no schema, a small completion with the
configured model name (``ClientConfig.model``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from llm_client.answers import AnswerValidator, parse_body, read_body, validated
from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.errors import InvalidAnswer, LLMError
from llm_client.fleet import Fleet
from llm_client.status import raise_for_status
from llm_client.transport import SessionSource, mapped_transport_errors

log = logging.getLogger(__name__)

KNOWN_GOOD_MAX_BYTES = 64 * 1024
"""A forwarded request larger than this is not kept as a probe (a probe should be cheap to send, and
the gateway keeps the caller's bytes unparsed until a probe needs them)."""

PROBE_MAX_TOKENS = 16
"""Decode budget of a probe made from a forwarded request: enough for a well-formed, non-empty answer.
(A ``chat`` request keeps its own budget: its ``validate`` may need the whole answer.)"""

_STREAM_ONLY = ("stream_options", "disaggregated_params")
"""Fields a probe drops: it is never streamed, and a P/D hand-over cannot be replayed."""


_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")


def capped_budget(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with every decode budget at most the probe's cap, and ``max_tokens`` set to it when no
    budget is an int: a known-good request without one (or with a float) probed uncapped, so on a slow
    replica the probe ran into its timeout and kept a fixed replica quarantined. The cap is
    ``PROBE_MAX_TOKENS``, or the request's own ``min_tokens`` (an OpenAI-API extension vLLM and SGLang
    read) when that is larger: capped below it, the probe asked for less than its own minimum, the
    replica refused it (vLLM answers 400), and the replica stayed quarantined."""
    capped = dict(body)
    floor = capped.get("min_tokens")
    cap = PROBE_MAX_TOKENS
    if isinstance(floor, int) and not isinstance(floor, bool) and floor > cap:
        cap = floor
    for budget in _BUDGET_FIELDS:
        value = capped.get(budget)
        if isinstance(value, int) and not isinstance(value, bool):
            capped[budget] = min(value, cap)
        elif budget in capped:  # a float, a null or anything else: no cap a replica is sure to read
            capped[budget] = cap
    if not any(budget in capped for budget in _BUDGET_FIELDS):
        capped["max_tokens"] = cap
    return capped


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """A request a probe sends (not streamed), and the check its answer must pass (None: well formed
    and not empty)."""

    path: str
    body: dict[str, Any] | bytes
    """The JSON body, or a forwarded caller's bytes (parsed only when a probe sends them)."""
    validate: AnswerValidator | None

    def payload(self) -> bytes | None:
        """The probe's JSON, not streamed; None when forwarded bytes are not a JSON object, or one that
        orjson reads but will not write (nested past its 254 levels, where it reads 1,024): that raised
        in every probe task, before its ``try``, so the quarantined replica was never probed while that
        request was the pool's known-good one, with no log."""
        body = self.body
        if isinstance(body, bytes):
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                return None
            if not isinstance(parsed, dict):
                return None
            body = capped_budget(parsed)
        kept = {k: v for k, v in body.items() if k not in _STREAM_ONLY}
        try:
            return orjson.dumps({**kept, "stream": False})
        except orjson.JSONEncodeError:
            return None


class AnswerProber:
    """Sends the probes; keeps, per pool, the last request a replica answered well."""

    def __init__(self, config: ClientConfig, fleet: Fleet, session: SessionSource) -> None:
        self.config = config
        self.fleet = fleet
        self._session = session
        self._known_good: dict[bool, ProbeRequest] = {}
        """Per pool (context servers or not), the last request answered well."""
        self._failed: dict[str, ProbeRequest] = {}
        """Per replica, the last request it answered badly: its probe while no request is known good."""
        fleet.on_forget.append(self.forget)

    def _pool(self, endpoint: Endpoint) -> bool:
        return self.fleet.peers(endpoint) is self.fleet.context_endpoints

    def answered_well(self, endpoint: Endpoint, request: ProbeRequest) -> None:
        """``endpoint`` answered ``request`` well: it is the pool's known-good probe from now on."""
        if isinstance(request.body, bytes) and len(request.body) > KNOWN_GOOD_MAX_BYTES:
            return
        self._known_good[self._pool(endpoint)] = request

    def answered_badly(self, endpoint: Endpoint, request: ProbeRequest) -> None:
        if not endpoint.left:  # one that left was forgotten: its probe is not kept again
            self._failed[endpoint.name] = request

    def forget(self, endpoint: Endpoint) -> None:
        """The replica left the fleet."""
        self._failed.pop(endpoint.name, None)

    def due(self, endpoint: Endpoint) -> bool:
        return endpoint.healthy and endpoint.quarantined and self.fleet.answer_health.probe_due(endpoint)

    def probe_request(self, endpoint: Endpoint) -> ProbeRequest:
        """What ``endpoint``'s probe sends: the pool's known-good request, else the one it last failed,
        else a small completion with the configured model name."""
        for known in (self._known_good.get(self._pool(endpoint)), self._failed.get(endpoint.name)):
            if known is not None and known.payload() is not None:
                return known
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": "Reply with the word ok."}],
            "max_tokens": 4,
        }
        return ProbeRequest("/v1/chat/completions", body, None)

    async def probe(self, endpoint: Endpoint) -> None:
        """One probe of a quarantined replica: a pass re-admits it on probation, a failure keeps it out
        for another cool-down (``AnswerHealth``)."""
        request = self.probe_request(endpoint)
        payload = request.payload()
        assert payload is not None  # probe_request returns a request with one
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.attempt_s)
        headers = {"Content-Type": "application/json"}
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                async with self._session().post(
                    endpoint.url + request.path, data=payload, headers=headers, timeout=timeout
                ) as response:
                    if response.status >= 400:
                        await raise_for_status(response, endpoint)
                    raw = await read_body(response, self.config.answer_limits, endpoint.name)
            completion = parse_body(raw, endpoint.name, time.perf_counter())
            if request.validate is not None:
                validated(request.validate, completion, endpoint.name)
            elif not completion.text.strip():
                raise InvalidAnswer("probe answer is empty", kind="empty", endpoint=endpoint.name)
        except LLMError as exc:
            self.fleet.answer_health.probe_failed(endpoint, str(exc))
            return
        self._failed.pop(endpoint.name, None)
        self.fleet.lift_quarantine(endpoint)
