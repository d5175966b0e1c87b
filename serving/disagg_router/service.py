"""One request through the front end, as ``trtllm-serve disaggregated`` does it (context first:
``OpenAIDisaggregatedService._send_disagg_request_ctx_first`` in ``tensorrt_llm/serve/``):

1. With ``conditional_disagg_config``, the generation router picks (and reserves) a generation server
   first, and the request needs a context server only if nothing of it matched there or more than
   ``max_local_prefill_length`` of it is uncached (``needs_context``). Otherwise it always does.
2. A context request is the client's with ``stream`` off and ``disaggregated_params.request_type``
   ``context_only``, sent to the server the context router picks (excluding the reserved generation
   server). Its answer must carry one choice with ``disaggregated_params``; if that choice already
   finished (``finish_reason`` neither ``length`` nor ``not_finished``: the first token was the whole
   answer) the client gets it and no generation server is asked.
3. The generation request is the client's, with the context answer's ``disaggregated_params`` as
   ``generation_only`` (or untouched, prefilled locally), sent to the reserved generation server or to
   the one the generation router picks now (excluding the context server). Its answer is relayed:
   streamed chunk by chunk if the client asked for a stream, else as JSON.

Each router hears of the end of every request it routed; a ``kv_cache_aware`` router's server is then
polled for its KV cache events before the answer is complete (TensorRT-LLM's ``finish_request``), so
the next request is routed on what this one stored. Not rebuilt: the ``generation_first`` schedule
style, prompts replaced by the context server's token ids (the simulator answers none), usage rewritten
from the context answer, and the Prometheus counters (``Counters`` here).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from serving.disagg_router.config import DisaggConfig
from serving.disagg_router.errors import BadContextResponse
from serving.disagg_router.perf_metrics import DisaggPerfMetrics, DisaggRequestTimes
from serving.disagg_router.routers import KvCacheAwareRouter, Routed, Router, RouteRequest, make_router
from serving.disagg_router.workers import Workers
from serving.simulator.protocol import ChatCompletionRequest, CompletionRequest

CONTINUES = ("length", "not_finished")
"""A context answer's ``finish_reason`` that leaves tokens for a generation server."""


def needs_context(matched_tokens: int, prompt_tokens: int, max_local_prefill_length: int) -> bool:
    """TensorRT-LLM's conditional rule: remote prefill unless something matched on the generation
    server and at most ``max_local_prefill_length`` tokens are left to compute there."""
    return matched_tokens == 0 or prompt_tokens - matched_tokens > max_local_prefill_length


@dataclass
class Counters:
    """Requests by path, for ``GET /health`` (TensorRT-LLM's ``ctx_``/``gen_total_requests``)."""

    requests: int = 0
    context_requests: int = 0
    generation_requests: int = 0
    local_prefills: int = 0
    """Requests the conditional rule sent straight to a generation server."""
    finished_on_context: int = 0
    errors: int = 0


@dataclass
class _Clock:
    dispatch: float = 0.0
    ctx_done: float = 0.0
    first: float | None = None
    last: float = 0.0
    generation_finished: bool = False
    """The generation router was told of this request's end (once only: a client that goes away after
    that, during the KV-event poll or ``write_eof``, must not take its load off a second time)."""


@dataclass
class DisaggService:
    config: DisaggConfig
    workers: Workers
    clock: Callable[[], float] = time.monotonic
    context_router: Router = field(init=False)
    generation_router: Router = field(init=False)
    perf: DisaggPerfMetrics = field(init=False)
    counters: Counters = field(default_factory=Counters)
    _drained: dict[str, list[dict[str, Any]]] = field(init=False, default_factory=dict)
    """Records drained from servers by a ``/perf_metrics`` call that failed on another server, kept for
    the next call (a server's drain hands over its only copy; the newest ``perf_metrics_max_requests``
    per server, as ``DisaggPerfMetrics`` keeps)."""

    def __post_init__(self) -> None:
        ctx, gen = self.config.context_servers, self.config.generation_servers
        self.context_router = make_router(ctx.router_settings(), ctx.base_urls())
        self.generation_router = make_router(gen.router_settings(), gen.base_urls())
        self.perf = DisaggPerfMetrics(self.config.perf_metrics_max_requests)

    async def serve(
        self, request: web.Request, body: dict[str, Any], parsed: ChatCompletionRequest | CompletionRequest
    ) -> web.StreamResponse:
        """Answer one OpenAI request (``body`` as received, ``parsed`` its validated form); raises
        ``DisaggError`` subclasses for the app to turn into 500s."""
        arrival = self.clock()
        self.counters.requests += 1
        route = RouteRequest.of(parsed)
        clock = _Clock()
        gen: Routed | None = None
        ctx: Routed | None = None
        try:
            need_ctx = True
            condition = self.config.conditional_disagg_config
            if condition is not None:
                gen = self.generation_router.choose(route)
                need_ctx = needs_context(
                    gen.matched_tokens, gen.prompt_tokens, condition.max_local_prefill_length
                )
            gen_body = _without_context_params(body)
            ctx_request_id: int | None = None
            if need_ctx:
                reserved = gen.server if gen is not None else None
                ctx = self.context_router.choose(route.as_type("context_only"), exclude=reserved)
                answer = await self._context(request.path, ctx, body, clock)
                params = _context_params(answer, ctx.server)
                ctx_request_id = int(params["ctx_request_id"])
                if answer["choices"][0].get("finish_reason") not in CONTINUES:
                    self.counters.finished_on_context += 1
                    return await _finished_on_context(request, answer, bool(body.get("stream")))
                gen_body = {**body, "disaggregated_params": {**params, "request_type": "generation_only"}}
            else:
                self.counters.local_prefills += 1
            if gen is None:
                gen_route = route.as_type("generation_only" if need_ctx else None)
                gen = self.generation_router.choose(gen_route, exclude=ctx.server if ctx else None)
            self.counters.generation_requests += 1
            response = await self._generation(request, gen, gen_body, clock)
            if ctx is not None and ctx_request_id is not None and clock.first is not None:
                self.perf.add(
                    DisaggRequestTimes(
                        ctx.server,
                        gen.server,
                        ctx_request_id,
                        arrival,
                        clock.dispatch,
                        clock.ctx_done,
                        clock.first,
                        clock.last,
                    )
                )
            return response
        except BaseException:
            self.counters.errors += 1
            raise
        finally:
            if gen is not None and not clock.generation_finished:
                clock.generation_finished = True
                await self._finish(self.generation_router, gen, success=False)

    async def _context(self, path: str, ctx: Routed, body: dict[str, Any], clock: _Clock) -> dict[str, Any]:
        prefill = {
            **body,
            "stream": False,
            "stream_options": None,
            "disaggregated_params": {"request_type": "context_only"},
        }
        self.counters.context_requests += 1
        clock.dispatch = self.clock()
        success = False
        try:
            answer = await self.workers.post_json(f"{ctx.server}{path}", prefill)
            clock.ctx_done = self.clock()
            success = True
        finally:
            await self._finish(self.context_router, ctx, success=success)
        return answer

    async def _generation(
        self, request: web.Request, gen: Routed, body: dict[str, Any], clock: _Clock
    ) -> web.StreamResponse:
        """Relay the generation server's answer; the router hears of its end before the client does."""
        url = f"{gen.server}{request.path}"
        if not body.get("stream"):
            answer = await self.workers.post_json(url, body)
            clock.first = clock.last = self.clock()
            clock.generation_finished = True
            await self._finish(self.generation_router, gen, success=True)
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        async with self.workers.open_stream(url, body) as upstream:
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                if chunk:
                    if clock.first is None:
                        clock.first = self.clock()
                    await out.write(chunk)
        clock.last = self.clock()
        clock.generation_finished = True
        await self._finish(self.generation_router, gen, success=True)
        await out.write_eof()
        return out

    async def _finish(self, router: Router, routed: Routed, *, success: bool) -> None:
        router.finish(routed, success=success)
        if isinstance(router, KvCacheAwareRouter):
            events = await asyncio.shield(self.workers.kv_cache_events(routed.server))
            if events is not None:
                router.apply_events(routed.server, events)

    async def collect_perf_metrics(self) -> list[dict[str, Any]]:
        """``GET /perf_metrics``: every server's records fetched, then joined (see ``perf_metrics``).
        A server that fails raises its error, and what the others handed over is kept for the next call
        (it was discarded: those records were gone for good), which joins it once every server answered."""
        limit = self.config.perf_metrics_max_requests
        if limit == 0:
            return []
        servers = [*self.context_router.servers, *self.generation_router.servers]
        fetched = await asyncio.gather(
            *(self.workers.perf_metrics(s) for s in servers), return_exceptions=True
        )
        for server, records in zip(servers, fetched, strict=True):
            if not isinstance(records, BaseException):
                kept = self._drained.setdefault(server, [])
                kept.extend(records)
                del kept[: max(len(kept) - limit, 0)]  # the oldest go first, as in ``DisaggPerfMetrics``
        failed = next((r for r in fetched if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        drained, self._drained = self._drained, {}
        return self.perf.collect(drained)


def _without_context_params(body: dict[str, Any]) -> dict[str, Any]:
    """A locally prefilled request must not carry a ``context_only`` request type to the generation
    server (TensorRT-LLM clears it)."""
    params = body.get("disaggregated_params")
    if isinstance(params, dict) and params.get("request_type") == "context_only":
        return {k: v for k, v in body.items() if k != "disaggregated_params"}
    return body


def _context_params(answer: dict[str, Any], server: str) -> dict[str, Any]:
    """The context answer's ``disaggregated_params`` (TensorRT-LLM's ``_verify_ctx_response``)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise BadContextResponse(f"{server}: a context answer must have exactly one choice")
    params = choices[0].get("disaggregated_params")
    if not isinstance(params, dict):
        raise BadContextResponse(f"{server}: Context server did not return disaggregated params")
    if params.get("ctx_request_id") is None:
        raise BadContextResponse(f"{server}: Invalid disaggregated params in context phase response")
    return params


async def _finished_on_context(
    request: web.Request, answer: dict[str, Any], stream: bool
) -> web.StreamResponse:
    """The first token was the whole answer: the context answer without its params, or, for a
    streamed request, an empty stream (TensorRT-LLM's ``done_generator``)."""
    if not stream:
        choice = {k: v for k, v in answer["choices"][0].items() if k != "disaggregated_params"}
        return web.json_response({**answer, "choices": [choice]})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
