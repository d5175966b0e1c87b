"""The request path: route, forward, pass the answer back byte for byte.

Guarantees:
- the replica receives the caller's body unchanged, plus the routing key as ``x-session-id``;
- the caller receives the replica's status, content type and body unchanged; a stream is written on
  chunk by chunk as the replica's chunks arrive (no buffering of a streamed answer), and ends at its
  ``data: [DONE]``: the replica's connection is not read further;
- failures before the answer starts (refused connection, timeout, 5xx, 429, a replica dying before its
  status line, which for a non-streamed answer comes with the whole body) are retried on another
  replica by the LLM client, under its retry budget and deadline; when none succeeds the caller gets an
  OpenAI-style error body with 502 (the last replica failed), 503 (no replica routable, or retry budget
  spent) or 504 (deadline);
- a replica that breaks off after the first byte cannot be retried (bytes are already with the caller):
  the caller's connection is closed without the stream's end, so it sees a truncated answer, never a
  silently short one; so is a stream the deadline cuts after its status line, counted as the 504 it
  would have been answered before it (``_broken_off``), not as a replica's broken answer;
- a caller that goes away closes the replica's connection too, so the replica stops generating;
- a 2xx answer read to its end is judged once (``llm_client.forwarding.answer_problem``): a broken one
  (not a JSON object with ``choices``, or a stream with an ``error`` event) still reaches its callers as
  it came, but counts as a bad answer for its replica and is not kept for a repeat of its key;
- a body of ``offload_body_bytes`` or more is parsed and hashed for routing in a worker thread, so one
  large request does not stall every other request's stream on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

import orjson
from aiohttp import web

from gateway.config import GatewaySettings, Priority
from gateway.flights import Flight, GatewayAnswer, Head
from gateway.idempotency import IDEMPOTENCY_HEADER, IdempotencyStore, KeyReused, request_digest
from gateway.metrics import GatewayMetrics
from gateway.overload import PRIORITY_CLASS, Admission, Entry, Refused, Verdict
from gateway.route import InvalidRequest, bounded_key, models_route, route_for
from gateway.supersede import SessionClaims, Version, parse_version, version_text
from llm_client.client import LLMClient
from llm_client.errors import (
    AttemptTimeout,
    DeadlineExceeded,
    LLMError,
    NoHealthyEndpoint,
    Overloaded,
    RetryBudgetExhausted,
)
from llm_client.forwarding import answer_problem
from llm_client.gateway_headers import FLEET_SIZE_HEADER, SERVED_BY_HEADER, SUPERSEDED_BY_HEADER
from llm_client.passthrough import Forwarded
from llm_client.routing import RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy

log = logging.getLogger(__name__)

FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
"""Caller headers the replica sees (besides ``x-session-id``). Never the caller's ``Authorization``:
the replicas get the gateway's own key (``LLM_SECURITY__API_KEY``), and a caller's key is not theirs."""
CALLER_CHECK_S = 0.25
"""How often a waiting request looks whether its caller is still connected."""

PASSED_RESPONSE_HEADERS = ("content-type", "cache-control", "x-replica-id", "x-request-id")
"""Replica headers the caller sees; the gateway adds its own (``_answer_headers``)."""


class OpenAIProxy:
    """Handlers for ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``."""

    def __init__(self, client: LLMClient, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(
            settings,
            self._routable,
            lambda refusal: metrics.refused.labels(refusal.priority, refusal.reason).inc(),
        )
        self.idempotency = IdempotencyStore(settings.idempotency_ttl_s, settings.idempotency_max_bytes)
        self.claims = SessionClaims(settings.session_versions_kept)
        self._flights: dict[asyncio.Task[None], Flight] = {}
        self._closed = False
        metrics.watch(self.admission, self.idempotency)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.read()
        try:
            if len(body) >= self.settings.offload_body_bytes:
                route = await asyncio.to_thread(self._route, body, request.headers)
            else:
                route = self._route(body, request.headers)
            priority = self._priority(request.headers)
            session = self._session(request.headers)
            key = bounded_key(request.headers.get(IDEMPOTENCY_HEADER), IDEMPOTENCY_HEADER)
        except InvalidRequest as exc:
            return self._error(request, 400, str(exc), "invalid_request_error", exc.param)
        # The session is part of what a key stands for, versioned or not: another session's request
        # under the same key was answered with the call made on the first session's replica.
        scope = (
            request.headers.get(self.settings.shopper_key_header, "")
            if session is None
            else f"{session[0]}\n{version_text(session[1])}"
        )
        digest = b"" if key is None else request_digest("POST", request.path, body, scope)
        if key is not None:
            try:
                found = self.idempotency.find(key, digest)
            except KeyReused as exc:
                return self._error(request, 422, str(exc), "invalid_request_error", IDEMPOTENCY_HEADER)
            if found is not None:
                outcome, flight = found
                self.metrics.idempotent.labels(outcome).inc()
                return await self._answer(request, flight, started, outcome)
        if self._closed:
            return self._gateway_answer(request, _stopping())
        flight = Flight(keep_running=key is not None)
        arrival = self._arrive(flight, session, priority)
        if isinstance(arrival, GatewayAnswer):
            return self._gateway_answer(request, arrival)
        verdict, displaced = arrival
        if key is not None:
            self.idempotency.track(key, digest, flight)
        # The call may outlive this handler (a keyed one whose caller left): it keeps its own copies.
        headers = {n: request.headers[n] for n in FORWARDED_REQUEST_HEADERS if n in request.headers}
        # Entered before anything is awaited, so the next request of this loop tick counts this one.
        entry = self.admission.enter(verdict)
        if displaced is not None and session is not None:
            # Only now, with this request's place taken: the older call's slot goes to the best waiter
            # when it unwinds, and this request's wait for it (``enter``'s task) must be in the gate by
            # then. Superseded before, the older call gave its slot to a lower-class waiter already in
            # the gate, and a high-priority newer version waited behind it or was refused.
            self._supersede(displaced, *session)
        task = asyncio.create_task(self._fly(flight, key, request.path, body, route, headers, entry, started))
        entry.owner = task
        flight.start(task)
        self._flights[task] = flight
        task.add_done_callback(self._flights.pop)
        task.add_done_callback(lambda _: self._ended(flight, key, session, entry))
        return await self._answer(request, flight, started, None)

    def _priority(self, headers: Mapping[str, str]) -> Priority:
        text = headers.get(self.settings.priority_header)
        if text is None:
            return self.settings.default_priority
        value = text.strip().lower()
        if value not in PRIORITY_CLASS:
            raise InvalidRequest(
                f"{self.settings.priority_header} must be one of {sorted(PRIORITY_CLASS)}, not {text!r}",
                self.settings.priority_header,
            )
        return value

    def _session(self, headers: Mapping[str, str]) -> tuple[str, Version] | None:
        """(session, version) when the caller says which version of its session this is."""
        header = self.settings.session_version_header
        text = headers.get(header)
        if text is None:
            return None
        session = headers.get(self.settings.shopper_key_header)  # its length bounded by ``route_for``
        if not session:
            raise InvalidRequest(f"{header} needs the session in {self.settings.shopper_key_header}", header)
        return session, parse_version(text, header)

    def _arrive(
        self, flight: Flight, session: tuple[str, Version] | None, priority: Priority
    ) -> tuple[Verdict, Flight | None] | GatewayAnswer:
        """Admission's verdict on ``flight`` and its session's claim (a 429 or a 409 answer instead,
        when it gets none), all synchronous, so that ``Admission.enter`` follows before anything else
        arrives; with the session's older call it displaces, which the caller supersedes once the
        verdict is entered. A newer version is judged before it supersedes the session's running call: refused
        after, it had cost the older call too (dropped from the queue or its request closed), and the
        session was left with no call at all. Any other is judged after its claim, so a version older
        than the session's newest is a 409 whatever the load."""
        older = None if session is None else self._running_call(session)
        verdict = None if older is None else self._judge_over(older, priority)
        if verdict is not None and verdict.refusal is not None:
            return _overloaded(verdict.refusal)
        displaced = None
        if session is not None:
            newer, displaced = self.claims.arrive(*session, flight)
            if newer is not None:
                self.metrics.superseded.labels("arrival").inc()
                return _superseded(session[0], newer, "(it arrived after it)")
        if verdict is None:
            verdict = self.admission.judge(priority)
            if verdict.refusal is not None:
                if session is not None:
                    self.claims.leave(session[0], flight)
                return _overloaded(verdict.refusal)
        return verdict, displaced

    def _running_call(self, session: tuple[str, Version]) -> Flight | None:
        """The session's call a newer ``session`` version would supersede, if one still runs."""
        older = self.claims.displaceable(*session)
        return None if older is None or older.ended or older.task is None else older

    def _judge_over(self, older: Flight, priority: Priority) -> Verdict:
        """Admission's verdict on a request superseding ``older``, counting what ``older`` frees: its
        place in the queue, or (sent and to be cancelled) its slot."""
        if older.stage != "sent":
            return self.admission.judge(priority, older.task)
        if not self.settings.cancel_superseded_in_flight:
            return self.admission.judge(priority)  # the older call goes on: it frees nothing
        return self.admission.judge(priority, frees_slot=True)

    def _supersede(self, flight: Flight, session: str, version: Version) -> None:
        """Stop ``flight`` for the session's newer ``version``, counted by the stage it was stopped at."""
        stage = flight.supersede(
            _superseded(session, version, ""),
            cancel_in_flight=self.settings.cancel_superseded_in_flight,
        )
        if stage == "waiting":
            self.metrics.superseded.labels("queued").inc()
        elif stage == "sent":
            self.metrics.cancelled.inc()

    def _ended(
        self, flight: Flight, key: str | None, session: tuple[str, Version] | None, entry: Entry
    ) -> None:
        self.admission.leave(entry)  # a task cancelled before its first step never took its place over
        if key is not None:
            self.idempotency.ended(key, flight)
        if session is not None:
            self.claims.leave(session[0], flight)

    async def _fly(
        self,
        flight: Flight,
        key: str | None,
        path: str,
        body: bytes,
        route: RouteRequest,
        headers: Mapping[str, str],
        entry: Entry,
        started: float,
    ) -> None:
        """The flight's own task: a slot, the upstream call, the answer into the flight's buffer. A 2xx
        answer read to its end is judged once (``answer_problem``): that one verdict tells the fleet
        (raised into ``forward``'s block, a bad answer for the replica) and decides whether the answer
        is kept for ``key``'s repeats; its callers get it as the replica sent it either way. The
        deadline counts from the request's arrival (``started``), the wait for a slot included."""
        problem: LLMError | None = None
        deadline_s = self._deadline_s()
        try:
            async with self.admission.slot(entry, deadline_s - (time.perf_counter() - started)):
                left_s = deadline_s - (time.perf_counter() - started)
                if left_s <= 0:  # granted just as the deadline passed
                    raise DeadlineExceeded(f"no answer within the {deadline_s:.3f} s deadline")
                flight.sent()
                async with self.client.forward(
                    path, body, route, headers=headers, deadline_s=left_s
                ) as answer:
                    streaming = answer.headers.get("content-type", "").startswith("text/event-stream")
                    flight.answer_head(Head(answer.status, self._answer_headers(answer), streaming))
                    # Read up to ``[DONE]`` only (``Forwarded.chunks``), so the call ends with its
                    # answer, not when the replica closes: a caller reads to ``[DONE]`` and may send
                    # its next request at once, and the same session's next version superseded a call
                    # not ended yet, so its answer was paid for and not kept for a repeat.
                    async for chunk in answer.chunks():
                        flight.append(chunk)
                    problem = answer_problem(answer, path)
                    if problem is not None:
                        raise problem
                    # A stream that ended without ``[DONE]`` may be short: passed on, never kept.
                    whole = not streaming or answer.tap.done
        except Refused as exc:
            flight.end(answer=_overloaded(exc))
            return
        except LLMError as exc:
            if exc is problem:  # read whole, and no answer: passed on as it came, never kept
                # Not held past here: its traceback holds this frame (a cycle for the collector).
                problem = None
                flight.end(complete=True)
            elif flight.head is None:
                flight.end(answer=_error_answer(exc))
            else:
                # Kept without its traceback: that names this frame, which holds the flight, so the
                # flight would hold itself in a reference cycle until the cyclic collector ran.
                flight.end(error=exc.with_traceback(None))
                if isinstance(flight.head, Head) and flight.head.streaming:  # else its callers get a 502
                    self._count_broken(exc)  # once for the call, however many callers share it
            return
        flight.end(complete=True)
        if key is not None and whole:
            self.idempotency.answered(key, flight)

    async def _answer(
        self, request: web.Request, flight: Flight, started: float, note: str | None
    ) -> web.StreamResponse:
        """Write ``flight``'s answer to this caller (one of possibly several)."""
        flight.attach()
        response: web.StreamResponse | None = None
        try:
            await _until(request, flight, lambda: flight.head is not None or flight.ended)
            head = flight.head or GatewayAnswer(499, "cancelled", "the call was stopped")
            if isinstance(head, GatewayAnswer):
                return self._gateway_answer(request, head)
            headers = dict(head.headers)
            # The count now: a kept answer's is from when it came (up to the TTL ago), and a client
            # sizes its admission limit by it.
            headers[FLEET_SIZE_HEADER] = str(self._routable())
            if note is not None:
                headers["x-gateway-idempotent"] = note
            if head.streaming:
                response = web.StreamResponse(status=head.status, headers=headers)
                await response.prepare(request)
                await self._write_flight(request, response, flight, started)
                if not flight.complete:
                    return await self._end_stopped_stream(request, response, flight)
                await response.write_eof()
            else:
                await _until(request, flight, lambda: flight.ended)
                if not flight.complete:
                    if flight.superseded is not None:
                        return self._gateway_answer(request, flight.superseded)
                    if flight.error is None:  # stopped after its status line, not broken off
                        stopped = flight.stopped or GatewayAnswer(499, "cancelled", "the call was stopped")
                        return self._gateway_answer(request, stopped)
                    return self._gateway_answer(request, _error_answer(flight.error))
                response = web.Response(body=flight.body_bytes(), status=head.status, headers=headers)
        except ConnectionResetError:  # the caller went away (its call is stopped unless kept running)
            self.metrics.requests.labels(request.path, "caller_gone").inc()
            return response if response is not None else web.Response(status=499)
        finally:
            flight.detach()
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        self.metrics.latency.labels(request.path).observe(time.perf_counter() - started)
        return response

    async def _write_flight(
        self, request: web.Request, response: web.StreamResponse, flight: Flight, started: float
    ) -> None:
        """The flight's chunks from the first, written on as they arrive, until the call ends."""
        written = 0
        while True:
            chunks = flight.chunks
            while written < len(chunks):
                await response.write(chunks[written])
                if written == 0:
                    self.metrics.first_byte.labels(request.path).observe(time.perf_counter() - started)
                written += 1
            if flight.ended:
                return
            if written:
                await flight.changed()  # a write to a caller that left raises (``ConnectionResetError``)
            else:
                # Until the first chunk nothing is written: a caller that leaves while the replica
                # queues and prefills would go unnoticed, and the replica compute on for nobody.
                await _until(request, flight, lambda: bool(flight.chunks) or flight.ended)

    async def _end_stopped_stream(
        self, request: web.Request, response: web.StreamResponse, flight: Flight
    ) -> web.StreamResponse:
        """A stream stopped after its status line. At an event's end it ends with an ``error`` event
        holding what the gateway would have answered before it (``error_event``: a newer version's 409,
        a deadline's 504, a replica's 502, the gateway stopping's 503), then its end, so the caller hears
        why it stopped. Cut off instead, a caller saw a broken connection: ``LLMClient`` ejected the
        endpoint that broke it at once (the gateway, often its only one), and every call of that process
        waited for the next health check, for one replica's failure or one call's deadline. Mid-event
        its connection is still closed without the stream's end: an event after half a one would read
        as a malformed answer, worse than a cut."""
        if flight.error is not None:  # counted, when a replica broke it, where the call ended (``_fly``)
            answer, status = _error_answer(flight.error), _broken_off(flight.error)
        elif flight.superseded is not None:
            answer, status = flight.superseded, "superseded"
        else:
            answer = flight.stopped or GatewayAnswer(499, "cancelled", "the call was stopped")
            status = "cancelled"
        if _at_event_end(flight):
            await response.write(error_event(answer))
            await response.write_eof()
        elif request.transport is not None:
            request.transport.close()
        self.metrics.requests.labels(request.path, status).inc()
        return response

    def _answer_headers(self, answer: Forwarded) -> dict[str, str]:
        """The replica's headers the caller may see, plus which replica answered and how many are
        routable (``llm_client.gateway_headers``: a client sizes its admission limit by it)."""
        headers = {name: answer.headers[name] for name in PASSED_RESPONSE_HEADERS if name in answer.headers}
        headers[SERVED_BY_HEADER] = answer.endpoint.name
        headers[FLEET_SIZE_HEADER] = str(self._routable())
        headers["x-gateway-attempts"] = str(answer.attempts)
        return headers

    def _routable(self) -> int:
        """Replicas the policy may route to now."""
        return sum(e.routable for e in self.client.endpoints)

    def _deadline_s(self) -> float:
        """The whole request's deadline: the gateway's own, else its client's."""
        return self.settings.deadline_s or self.client.config.timeouts.deadline_s

    async def close(self) -> None:
        """Stop the calls still running (kept-running ones too) and drop the answers kept for
        repeats: the gateway is stopping. Each call's callers get a 503 with ``Retry-After``, which a
        client in front retries on another gateway; the 499 of a cancelled call was a 4xx, its own
        fault to such a client (``BadRequest``), so a restart failed every call in flight."""
        self._closed = True
        for task, flight in list(self._flights.items()):
            flight.end(answer=_stopping())  # first: the cancelled task's own end is then a no-op
            task.cancel()
        await asyncio.gather(*self._flights, return_exceptions=True)
        self.idempotency.close()

    def _route(self, body: bytes, headers: Mapping[str, str]) -> RouteRequest:
        """The policy's view of the body, with the prompt's block hashes already computed when the
        policy routes by them: parsing and hashing are linear in the body (about 40 ms a MiB), so
        ``generate`` runs this in a worker thread for large bodies and the event loop never waits on
        it. The route is new and the hashes land in its own ``memo``; what it shares is the policy's
        ``PromptTokenizer``, whose memory of recent prompts takes a lock (several threads route at
        once, and the loop itself routes small bodies)."""
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
        problem: LLMError | None = None
        try:
            async with self.client.forward(
                request.path, body, route, method=method, headers=headers, deadline_s=self.settings.deadline_s
            ) as answer:
                if answer.headers.get("content-type", "").startswith("text/event-stream"):
                    response = web.StreamResponse(status=answer.status, headers=self._answer_headers(answer))
                    await self._stream(request, response, answer, started)
                else:
                    payload = await answer.read()
                    response = web.Response(
                        body=payload, status=answer.status, headers=self._answer_headers(answer)
                    )
                    problem = answer_problem(answer, request.path)
                    if problem is not None:
                        raise problem  # a bad answer for the replica (the fleet is told); passed on
        except LLMError as exc:
            if exc is not problem or response is None:
                return self._forward_failed(request, response, exc)
            # Read whole and no answer: the caller gets it as the replica sent it. Not held past here:
            # its traceback holds this frame (a cycle for the collector).
            problem = None
        except ConnectionResetError:  # the caller went away; the replica's connection is closed too
            self.metrics.requests.labels(request.path, "caller_gone").inc()
            return response if response is not None else web.Response(status=499)
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        self.metrics.latency.labels(request.path).observe(time.perf_counter() - started)
        return response

    def _forward_failed(
        self, request: web.Request, response: web.StreamResponse | None, exc: LLMError
    ) -> web.StreamResponse:
        if response is None or not response.prepared:
            return self._gateway_answer(request, _error_answer(exc))
        # Bytes are already with the caller: end its connection without the stream's end.
        status = _broken_off(exc)
        self._count_broken(exc)
        if request.transport is not None:
            request.transport.close()
        self.metrics.requests.labels(request.path, status).inc()
        return response

    def _count_broken(self, exc: LLMError) -> None:
        """A stream ``exc`` cut after its status line, counted and logged once when a replica broke it
        (a deadline cut is the gateway's own: ``_broken_off``). Once per call: counted per caller, one
        broken stream that three callers shared by an ``Idempotency-Key`` counted three broken answers
        and logged three warnings."""
        if _broken_off(exc) == "broken":
            self.metrics.broken_streams.labels(exc.endpoint or "unknown").inc()
            log.warning("answer broke off mid-stream: %s", exc)

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

    def _gateway_answer(self, request: web.Request, answer: GatewayAnswer) -> web.Response:
        response = self._error(
            request, answer.status, answer.message, answer.kind, answer.param, answer.attempts
        )
        response.headers.update(answer.headers)
        return response

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


async def _until(request: web.Request, flight: Flight, ready: Callable[[], bool]) -> None:
    """Until ``ready()``, unless the caller's connection closes first (``ConnectionResetError``).
    aiohttp does not cancel the handler of a caller that left, and nothing is written to it while its
    request waits for a slot or for a whole (not streamed) answer: without this check a request queued
    for nobody would still be sent, under overload when the queue matters most."""
    while not ready():
        try:
            async with asyncio.timeout(CALLER_CHECK_S):
                while not ready():
                    await flight.changed()
        except TimeoutError:
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the caller went away") from None


def error_event(answer: GatewayAnswer) -> bytes:
    """The SSE event that ends a stream stopped after its status line: what ``answer`` (the status the
    gateway answers before it) says as an ``error``, as OpenAI-style clients read an error inside a
    stream; a newer version's adds ``superseded_by`` (the 409's header), which ``llm_client.answers``
    turns into ``SupersededByNewer``. Any other is a failure of the call, not a broken connection."""
    error: dict[str, object] = {
        "message": answer.message,
        "type": answer.kind,
        "param": answer.param,
        "code": answer.status,
    }
    if SUPERSEDED_BY_HEADER in answer.headers:
        error["superseded_by"] = answer.headers[SUPERSEDED_BY_HEADER]
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


def _at_event_end(flight: Flight) -> bool:
    """Whether what the caller got of ``flight`` ends at an event's end, where another event may start;
    a chunk that ended mid-event leaves the caller half an event, and only a cut says it broke."""
    return not flight.chunks or flight.chunks[-1].endswith((b"\n\n", b"\r\n\r\n"))


def _stopping() -> GatewayAnswer:
    """The answer of a call the gateway stops because it is stopping itself: a 503 asks the client in
    front to try again, on another gateway, where a 4xx told it the request was wrong."""
    return GatewayAnswer(503, "service_unavailable", "the gateway is stopping", headers={"Retry-After": "1"})


def _overloaded(refusal: Refused) -> GatewayAnswer:
    return GatewayAnswer(429, "overloaded", str(refusal), headers={"Retry-After": refusal.retry_after})


def _superseded(session: str, version: Version, when: str) -> GatewayAnswer:
    return GatewayAnswer(
        409,
        "superseded",
        f"superseded by version {version_text(version)} of session {session!r} {when}".strip(),
        headers={SUPERSEDED_BY_HEADER: version_text(version)},
    )


def _error_answer(exc: LLMError) -> GatewayAnswer:
    """The gateway's own answer when no replica answered (OpenAI-style ``error.type``).

    Replicas that refused for load (429) are answered 429 with the ``Retry-After`` the last of them
    asked for, also when the retry budget ran out on their refusals: a 502 or 503 told an
    ``LLMClient`` in front of the gateway that the gateway had failed, and two of those in a row ejected
    the gateway (a refusal counts against nobody's health). A retry budget spent on failures is a 503
    with ``Retry-After``: the gateway is alive and asks for a pause."""
    message, attempts = str(exc), exc.attempts
    if isinstance(exc, DeadlineExceeded | AttemptTimeout):
        return GatewayAnswer(504, "timeout", message, attempts=attempts)
    refusal = exc.__cause__ if isinstance(exc, RetryBudgetExhausted) else exc  # the budget ran out on 429s
    if isinstance(refusal, Overloaded):
        wait_s = max(1, math.ceil(refusal.retry_after_s or 1))
        return GatewayAnswer(
            429, "overloaded", message, attempts=attempts, headers={"Retry-After": str(wait_s)}
        )
    if isinstance(exc, RetryBudgetExhausted):
        return GatewayAnswer(
            503, "service_unavailable", message, attempts=attempts, headers={"Retry-After": "1"}
        )
    if isinstance(exc, NoHealthyEndpoint):
        return GatewayAnswer(503, "service_unavailable", message, attempts=attempts)
    return GatewayAnswer(502, "bad_gateway", message, attempts=attempts)


def _broken_off(exc: LLMError) -> str:
    """The ``gateway_requests_total`` status of a stream cut by ``exc`` after its status line. A deadline
    cut is the gateway's own: a 504, as it is answered before the status line, so the 504s count every
    deadline cut; no replica broke (counted as a broken answer, it named ``unknown``). Anything else
    broke off at its replica."""
    return "504" if isinstance(exc, DeadlineExceeded) else "broken"
