"""One attempt of a pass-through call (``LLMClient.forward``, for the gateway) on one replica.

The caller's bytes go to the replica unchanged; its answer comes back unread (``Forwarded``) once the
status line and headers are in. A 429 or 5xx is read as an error here (so it can be retried elsewhere);
any other status is the caller's to see. What the answer teaches (usage, first-byte time, an error event
inside a 200 stream) is learned only once the caller has read it to its end (``learn``). Whether a 2xx
answer read to its end is an answer at all is judged in one place, ``answer_problem``: the gateway
raises its verdict into ``LLMClient.forward``'s block, so the fleet counts a broken 200 as a bad answer
rather than a good one, and keeps no broken answer for a repeat of its ``Idempotency-Key``.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from llm_client.answers import usage_from_documents
from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.errors import EndpointUnavailable, InvalidAnswer, InvalidAnswerKind, LLMError
from llm_client.fleet import Fleet
from llm_client.passthrough import Forwarded
from llm_client.routing import RouteOutcome, RouteRequest
from llm_client.routing.base import prefill_observer
from llm_client.status import raise_for_status
from llm_client.transport import SessionSource, header_value, mapped_transport_errors

MODELS_PATH = "/v1/models"
"""The one forwarded route whose answer is a model list (``data``), not a completion (``choices``)."""


def answer_problem(forwarded: Forwarded, path: str) -> LLMError | None:
    """Why a 2xx answer read to its end is no answer, or None when it is well formed (or not 2xx: a
    replica's own 4xx is the caller's to see). A body that is not a JSON object with a non-empty
    ``choices`` list (``data`` list for ``/v1/models``) is an ``InvalidAnswer``, as the in-process
    client's ``parse_body`` judges it; a stream with an ``error`` event failed the request
    (``EndpointUnavailable``, as ``parse_stream`` raises it), and one whose first event is not a
    completion chunk, or that held no event, is an ``InvalidAnswer`` as ``read_stream`` judges it.
    Without this an HTML page, an empty body, an error event or a stream of the wrong shape sent with
    a 200 counted as a good answer, so such a replica was never quarantined, and it was kept for the
    key's failover retry. Judged from what the usage tap read in passing (``UsageTap``: its one parse
    of a whole body, a stream's first event and the events it decodes)."""
    if not 200 <= forwarded.status < 300:
        return None
    endpoint, tap = forwarded.endpoint.name, forwarded.tap
    if tap.streaming:
        raw = tap.head.decode("utf-8", "replace")
        if tap.error is not None:
            return EndpointUnavailable(f"error in stream: {tap.error}", endpoint=endpoint)
        if tap.bad_event is not None:
            message = f"stream event is not a completion chunk: {tap.bad_event}"
            return InvalidAnswer(message, kind="wrong_shape", endpoint=endpoint, raw=raw)
        if tap.events == 0:
            return InvalidAnswer("stream held no completion chunk", kind="empty", endpoint=endpoint, raw=raw)
        return None
    if tap.not_json is not None:
        kind: InvalidAnswerKind = "empty" if tap.blank else "not_json"
        message = f"answer is not JSON: {tap.not_json}"
        return InvalidAnswer(message, kind=kind, endpoint=endpoint, raw=tap.head.decode("utf-8", "replace"))
    field = "data" if path == MODELS_PATH else "choices"
    length = tap.lists.get(field)
    if length is None or (field == "choices" and not length):
        shape = "a" if field == "data" else "a non-empty"
        message = f"answer is not a JSON object with {shape} {field!r} list"
        raw = tap.head.decode("utf-8", "replace")
        return InvalidAnswer(message, kind="wrong_shape", endpoint=endpoint, raw=raw)
    return None


class Forwarder:
    def __init__(self, config: ClientConfig, fleet: Fleet, session: SessionSource) -> None:
        self.config = config
        self.fleet = fleet
        self._session = session

    async def attempt(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        body: bytes | None,
        route: RouteRequest,
        headers: Mapping[str, str],
    ) -> Forwarded:
        session = self._session()
        policy = self.fleet.policy
        forwarded = Forwarded(
            endpoint,
            route.max_tokens,
            policy.estimate_uncached_tokens(route, endpoint),
            max_bytes=self.config.answer_limits.max_answer_bytes,
            max_line_bytes=self.config.answer_limits.max_line_bytes,
        )
        forwarded.on_prefill_done = self.fleet.prefill_reporter(route, endpoint)
        observer = prefill_observer(policy)
        if observer is not None:
            forwarded.on_release = lambda: observer.attempt_over(route, endpoint)
        forwarded.hold()
        # The answer is passed on as it arrives, so ``attempt_s`` bounds a stall (no byte for that long),
        # not the whole answer: as ``total`` it cut a healthy stream longer than ``attempt_s`` mid-answer
        # and counted that against the replica (two in a row ejected it). The call's deadline
        # (``Calls.call``) bounds the whole.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.timeouts.connect_s, sock_read=self.config.timeouts.attempt_s
        )
        try:
            with mapped_transport_errors(endpoint.name, self.config.timeouts.attempt_s):
                forwarded.response = await session.request(
                    method,
                    endpoint.url + path,
                    data=body,
                    headers={**headers, "x-session-id": header_value(route.key)},
                    timeout=timeout,
                )
                if forwarded.response.status == 429 or forwarded.response.status >= 500:
                    await raise_for_status(forwarded.response, endpoint)
            return forwarded
        except InvalidAnswer as exc:
            self.fleet.bad_answer(endpoint, route, exc)  # before release: a failure is no first token
            forwarded.release()
            raise
        except LLMError as exc:
            # As for a parsed call: blocks gone at the pull are not the replica's failure, nor a 429.
            self.fleet.attempt_failed(endpoint, route, exc)
            forwarded.release()
            raise
        except BaseException:
            forwarded.release()
            raise

    def learn(self, forwarded: Forwarded, route: RouteRequest) -> None:
        """The caller read the answer to its end: teach the fleet what it said. A good answer counts as
        one for the replica's answer health too: a quarantine needs a *share* of bad answers, and
        without the good ones any three bad answers over the process's life made that share."""
        endpoint, tap = forwarded.endpoint, forwarded.tap
        # An error event inside a 200 stream: the replica failed the request. The gateway raised it
        # already (``answer_problem``); this is for a caller of ``LLMClient.forward`` that judges nothing.
        if tap.error is not None:
            self.fleet.failed(endpoint, route, connection=False)
            return
        prompt, cached, completion_tokens = usage_from_documents(tap.usage, tap.timings)
        latency = forwarded.finished_ms or 0.0
        first_token = tap.streaming and forwarded.first_byte_ms is not None
        ttft = forwarded.first_byte_ms if first_token and forwarded.first_byte_ms is not None else latency
        outcome = RouteOutcome(
            ok=True,
            prompt_tokens=prompt,
            cached_tokens=cached,
            latency_ms=latency,
            ttft_ms=ttft,
            completion_tokens=completion_tokens,
            first_token=first_token,
        )
        self.fleet.succeeded(endpoint, route, outcome)
