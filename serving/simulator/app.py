"""The HTTP face of one simulated trtllm-serve replica: ``create_app(config)`` builds it.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not), ``GET /health``,
``GET /v1/models``, ``GET /metrics`` (also at trtllm's ``/prometheus/metrics``), ``POST /kv_cache_events``
(trtllm's KV cache event poll, see ``serving.simulator.kv_events``; 404 when events are off),
``GET /perf_metrics`` (trtllm's per-request timelines, ``serving.simulator.perf_metrics``), on a context
replica ``POST /internal/kv_transfer`` (a generation replica's KV pull, ``serving.simulator.disagg``), and
the test-only admin routes of ``serving.simulator.admin``. Every response carries ``x-replica-id``. The
``x-session-id`` header is read and ignored, as a real engine would; ``cache_salt`` keeps tenants' cache
entries apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from prompt_assembly.validation import first_problem
from serving.simulator.admin import add_admin_routes
from serving.simulator.answers import Answer, UnfollowableSchema
from serving.simulator.bad_answers import bad_answer_response
from serving.simulator.config import Role, SimulatorConfig
from serving.simulator.disagg import KV_CACHE_GONE, KvCacheGone, OpaqueState, first_gen_token
from serving.simulator.engine import GenerationRequest
from serving.simulator.kv_transfer import PULL_PATH
from serving.simulator.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    KvPullRequest,
    RequestType,
    completion_body,
    error_body,
    usage_body,
)
from serving.simulator.replica import REPLICA_KEY, Replica
from serving.simulator.streaming import SseWriter, stream_tokens

RequestModel = TypeVar("RequestModel", bound=BaseModel)

_MAX_BODY_BYTES = 32 * 1024 * 1024


def create_app(config: SimulatorConfig) -> web.Application:
    """A ready-to-run aiohttp application with its own replica state (no globals)."""
    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    replica = Replica(config)
    app[REPLICA_KEY] = replica
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/prometheus/metrics", _metrics)
    app.router.add_post("/kv_cache_events", _kv_cache_events)
    app.router.add_get("/perf_metrics", _perf_metrics)
    app.router.add_post(PULL_PATH, _kv_transfer)
    add_admin_routes(app)
    app.on_response_prepare.append(_tag_replica)
    app.on_cleanup.append(replica.close)
    return app


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def error_response(message: str, status: int, error_type: str, param: str | None = None) -> web.Response:
    return json_response(error_body(message, error_type, status, param), status=status)


async def _tag_replica(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-replica-id"] = request.app[REPLICA_KEY].config.replica_id


async def _parse(request: web.Request, model: type[RequestModel]) -> RequestModel | web.Response:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(f"request body is not valid JSON: {exc}", 400, "invalid_request_error")
    if not isinstance(raw, dict):
        return error_response("request body must be a JSON object", 400, "invalid_request_error")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        param, message = first_problem(exc)
        return error_response(f"{param}: {message}", 400, "invalid_request_error", param)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _parse(request, ChatCompletionRequest)
    if isinstance(body, web.Response):
        return body
    return await _generate(request, "chat", body)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _parse(request, CompletionRequest)
    if isinstance(body, web.Response):
        return body
    return await _generate(request, "completion", body)


async def _generate(
    request: web.Request, endpoint: Endpoint, body: ChatCompletionRequest | CompletionRequest
) -> web.StreamResponse:
    replica = request.app[REPLICA_KEY]
    if replica.config.network_rtt_ms:
        await asyncio.sleep(replica.config.network_rtt_ms / 1000)  # another region's round trip
    metrics = replica.metrics
    metrics.requests.labels(endpoint).inc()
    _ = request.headers.get("x-session-id")  # routing hint for the router in front; an engine ignores it
    params = body.disaggregated_params
    request_type: RequestType = params.request_type if params else "context_and_generation"
    refusal = _role_refusal(replica.config.role, request_type)
    if refusal is not None:
        metrics.errors.labels("bad_request").inc()
        return error_response(refusal, 400, "invalid_request_error", "disaggregated_params.request_type")
    state: OpaqueState | None = None
    if request_type == "generation_only":
        assert params is not None and params.opaque_state is not None  # the model validator checked
        try:
            state = OpaqueState.decode(params.opaque_state)
        except ValueError as exc:
            metrics.errors.labels("bad_request").inc()
            return error_response(str(exc), 400, "invalid_request_error", "disaggregated_params.opaque_state")
    if replica.inject_error():
        metrics.errors.labels("injected").inc()
        return error_response("injected failure (simulator error_rate)", 503, "service_unavailable")
    bad = replica.draw_bad_answer()
    if bad is not None:
        metrics.errors.labels("bad_answer").inc()
        return bad_answer_response(bad, stream=body.stream)
    prompt_text = body.prompt_text()
    try:
        job, answer = replica.prepare(
            prompt_text,
            body.last_user_text(),
            max_tokens=body.token_limit(),
            response_format=body.response_format_dict(),
            cache_salt=body.cache_salt,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            streaming=body.stream and request_type != "context_only",
        )
    except UnfollowableSchema as exc:
        metrics.errors.labels("bad_request").inc()
        return error_response(str(exc), 400, "invalid_request_error", "response_format")
    if job.prompt_tokens == 0:
        metrics.errors.labels("bad_request").inc()
        return error_response("prompt is empty", 400, "invalid_request_error", "prompt")
    gen_only = request_type == "generation_only"
    too_long = oversize_refusal(
        replica.config, job.prompt_tokens, job.max_new_tokens, generation_only=gen_only
    )
    if too_long is not None:
        metrics.errors.labels("bad_request").inc()
        return error_response(too_long, 400, "invalid_request_error", "prompt")
    response_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + job.request_id
    model = body.model or replica.config.model_name
    if request_type == "context_only":
        return await _context_only(request, replica, endpoint, job, answer, response_id, model)
    if state is not None:
        # generation_only: decode after the context replica's first token, from its KV cache.
        job.kv_transfer = True
        job.kv_source = state.ctx_url
        job.ctx_request_id = state.ctx_request_id
        job.tokens_done = 1
    replica.engine.submit(job)
    if job.kv_transfer:
        try:
            await job.kv_settled.wait()
        finally:
            if not job.kv_settled.is_set():
                replica.engine.abort(job)
        if job.error is not None:
            metrics.errors.labels(job.error_type).inc()
            return error_response(job.error, job.error_status, job.error_type)

    if body.stream:
        options = body.stream_options
        response = await stream_tokens(
            request,
            replica.engine,
            job,
            SseWriter(endpoint, response_id, model, answer),
            include_usage=options.include_usage if options else False,
            continuous_usage=options.continuous_usage_stats if options else False,
            coalesce_s=replica.config.stream_coalesce_s,
        )
        _account(replica, job, request_type)
        return response

    started = asyncio.get_running_loop().time()
    try:
        await _await_answer(request, replica, job)
    finally:
        if not job.done.is_set():
            _settle_at_next_poll(replica, job, started, request_type)
    _account(replica, job, request_type)
    if job.error is not None:
        return error_response(job.error, job.error_status, job.error_type)
    usage = usage_body(job.prompt_tokens, job.completion_tokens, job.cached_tokens)
    return json_response(
        completion_body(endpoint, response_id, model, answer.text, answer.finish_reason, usage)
    )


def oversize_refusal(
    config: SimulatorConfig, prompt_tokens: int, max_tokens: int, *, generation_only: bool = False
) -> str | None:
    """Why trtllm-serve would refuse this prompt outright (a 400, never a queue): without chunked prefill
    a prompt must fit in one iteration's ``max_num_tokens`` (unless it is ``generation_only``: its KV
    cache comes from a context server, nothing of it is prefilled here), and prompt + ``max_tokens``
    must fit in ``max_seq_len``. The rules and messages are TensorRT-LLM's (``LLM._check_arguments``)."""
    if not config.enable_chunked_prefill and not generation_only and prompt_tokens > config.max_num_tokens:
        return (
            f"The sum of prompt length ({prompt_tokens}) and query length (0) should not exceed "
            f"max_num_tokens ({config.max_num_tokens})"
        )
    if prompt_tokens + max_tokens > config.max_seq_len:
        return (
            f"The sum of prompt length ({prompt_tokens}) and max_tokens ({max_tokens}) should not exceed "
            f"max_seq_len ({config.max_seq_len})"
        )
    return None


def _poll_s(replica: Replica) -> float:
    """Wall seconds between disconnect polls: ``disconnect_poll_s`` simulated seconds."""
    return replica.config.disconnect_poll_s * replica.knobs.time_scale


async def _await_answer(request: web.Request, replica: Replica, job: GenerationRequest) -> None:
    """Wait for ``job``, looking for a vanished client once per poll as trtllm-serve does
    (``await_disconnected``: ``is_disconnected()`` every second): the engine keeps computing an
    abandoned request until the next poll, then frees its slot; blocks it computed stay cached."""
    poll = _poll_s(replica)
    if poll <= 0:
        await job.done.wait()
        return
    while not job.done.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(poll):
                await job.done.wait()
        transport = request.transport
        if not job.done.is_set() and (transport is None or transport.is_closing()):
            replica.engine.abort(job)


def _settle_at_next_poll(replica: Replica, job: GenerationRequest, started: float, request_type: str) -> None:
    """The handler was cancelled (the server cancels handlers of closed connections): abort ``job`` at
    the poll that would have noticed, not at once; if it finished before that poll, count it as served
    (the engine served it, and no handler is left to count it)."""

    def settle() -> None:
        if job.done.is_set():
            _account(replica, job, request_type)
        else:
            replica.engine.abort(job)

    poll = _poll_s(replica)
    loop = asyncio.get_running_loop()
    if poll <= 0:
        settle()
        return
    loop.call_later(poll - (loop.time() - started) % poll, settle)


def _role_refusal(role: Role, request_type: RequestType) -> str | None:
    """Why this replica cannot serve this kind of request (a front end sent it to the wrong pool)."""
    if request_type == "context_only" and role != "context":
        return f"context_only requests need a replica with role context; this one is {role}"
    if request_type == "generation_only" and role != "generation":
        return f"generation_only requests need a replica with role generation; this one is {role}"
    return None


async def _context_only(
    request: web.Request,
    replica: Replica,
    endpoint: Endpoint,
    job: GenerationRequest,
    answer: Answer,
    response_id: str,
    model: str,
) -> web.Response:
    """Prefill, answer the first token (never streamed), and keep the prompt's KV blocks pinned for the
    generation replica's pull (``KvSender``)."""
    job.completion_tokens = job.max_new_tokens = 1
    job.keep_pinned = True
    job.ctx_request_id = replica.next_ctx_request_id()
    replica.engine.submit(job)
    try:
        await job.done.wait()
    finally:
        if not job.done.is_set():
            replica.engine.abort(job)
        elif job.error is None and not job.cancelled:
            replica.kv_sender.hold(job)  # even if this handler is cancelled now: the timeout frees them
    _account(replica, job, "context_only")
    if job.error is not None:
        return error_response(job.error, job.error_status, job.error_type)
    first = answer.pieces[0] if answer.pieces else ""
    state = OpaqueState(
        ctx_url=replica.config.advertise_url or f"{request.scheme}://{request.host}",
        ctx_request_id=job.ctx_request_id,
        block_hashes_count=len(job.block_hashes),
    )
    params = {
        "request_type": "context_only",
        "first_gen_tokens": [first_gen_token(first)],
        "ctx_request_id": job.ctx_request_id,
        "opaque_state": state.encode(),
        "draft_tokens": None,
    }
    finish_reason = answer.finish_reason if answer.completion_tokens <= 1 else "length"
    usage = usage_body(job.prompt_tokens, 1, job.cached_tokens)
    return json_response(completion_body(endpoint, response_id, model, first, finish_reason, usage, params))


def _account(replica: Replica, job: GenerationRequest, request_type: str) -> None:
    """Count a finished or failed request; an aborted one is counted by the engine's ``on_abort`` hook
    (``Replica._count_abort``), since a cancelled handler never gets here."""
    if job.cancelled:
        return
    if job.error is not None:
        replica.metrics.errors.labels("engine").inc()
    else:
        replica.record_finished(job, request_type)


async def _health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _kv_cache_events(request: web.Request) -> web.Response:
    """Drain the event buffer, as trtllm-serve's ``POST /kv_cache_events`` does (each event once)."""
    events = request.app[REPLICA_KEY].kv_events
    if events is None:
        return error_response(
            "KV cache events are off (kv_event_buffer_max_size is 0)", 404, "not_found_error"
        )
    return web.Response(body=orjson.dumps(events.drain()), content_type="application/json")


async def _perf_metrics(request: web.Request) -> web.Response:
    """Every kept request timeline since the last call, as trtllm-serve's ``GET /perf_metrics``."""
    return web.Response(
        body=orjson.dumps(request.app[REPLICA_KEY].drain_perf_metrics()), content_type="application/json"
    )


async def _kv_transfer(request: web.Request) -> web.Response:
    """A generation replica pulls a finished context_only prompt's KV blocks (those it lacks)."""
    replica = request.app[REPLICA_KEY]
    if replica.config.role != "context":
        message = f"this replica's role is {replica.config.role}, not context"
        return error_response(message, 404, "not_found_error")
    body = await _parse(request, KvPullRequest)
    if isinstance(body, web.Response):
        return body
    try:
        receipt = await replica.kv_sender.send(body.ctx_request_id, body.block_hashes)
    except KvCacheGone as exc:
        return error_response(str(exc), 404, KV_CACHE_GONE)
    return json_response(asdict(receipt))


async def _models(request: web.Request) -> web.Response:
    config = request.app[REPLICA_KEY].config
    card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "simulator"}
    return json_response({"object": "list", "data": [card]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[REPLICA_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
