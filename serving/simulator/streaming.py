"""Server-sent events for a streaming request, paced by the engine's token times.

The first chunk is written the moment the engine produces the first token (so the client measures the
simulated TTFT), later chunks as decode iterations complete. To keep fast time scales cheap, a stream
writes at most one chunk per ``coalesce_s`` wall seconds and puts every token produced meanwhile into it;
the final chunk is never held back. At ``time_scale`` 1 decode steps (~50 ms) are longer than the default
20 ms, so every token gets its own chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from serving.simulator.answers import Answer
from serving.simulator.engine import ContinuousBatchingEngine, GenerationRequest
from serving.simulator.protocol import Endpoint, chunk_body, error_body, usage_body

_DONE = b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class SseWriter:
    """Formats one request's chunks; knows nothing of timing."""

    def __init__(self, endpoint: Endpoint, response_id: str, model: str, answer: Answer) -> None:
        self.endpoint = endpoint
        self.response_id = response_id
        self.model = model
        self.answer = answer

    def text_between(self, start: int, end: int, finished: bool) -> str:
        # A JSON answer longer than max_tokens is still sent whole: the rest rides on the last token.
        pieces = self.answer.pieces
        return "".join(pieces[start:] if finished else pieces[start:end])

    def content(self, text: str, first: bool, usage: dict[str, Any] | None) -> bytes:
        return _event(
            chunk_body(self.endpoint, self.response_id, self.model, text=text, first=first, usage=usage)
        )

    def tail(self, usage: dict[str, Any], include_usage: bool) -> bytes:
        finish = chunk_body(
            self.endpoint,
            self.response_id,
            self.model,
            text=None if self.endpoint == "chat" else "",
            finish_reason=self.answer.finish_reason,
        )
        out = _event(finish)
        if include_usage:
            out += _event(
                chunk_body(
                    self.endpoint, self.response_id, self.model, text=None, usage=usage, with_choice=False
                )
            )
        return out + _DONE


async def stream_tokens(
    http_request: web.Request,
    engine: ContinuousBatchingEngine,
    job: GenerationRequest,
    writer: SseWriter,
    *,
    include_usage: bool,
    continuous_usage: bool,
    coalesce_s: float,
) -> web.StreamResponse:
    """Write ``job``'s tokens as they are produced; aborts the job if the client goes away."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http_request)
    sent = 0
    try:
        while True:
            await job.progress.wait()
            job.progress.clear()
            if job.error is not None or job.cancelled:
                if job.error is not None:
                    await response.write(_event(error_body(job.error, "service_unavailable", 503)) + _DONE)
                break
            done, finished = job.tokens_done, job.done.is_set()
            payload = b""
            if done > sent or finished:
                text = writer.text_between(sent, done, finished)
                usage = _usage(job, done) if continuous_usage else None
                payload = writer.content(text, first=sent == 0, usage=usage)
                sent = done
            if finished:
                payload += writer.tail(_usage(job, job.completion_tokens), include_usage)
            if payload:
                await response.write(payload)
            if finished:
                break
            if coalesce_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(coalesce_s):
                        await job.done.wait()
    except ConnectionError:  # the client went away: free its batch slot, nothing left to write to
        engine.abort(job)
    except asyncio.CancelledError:
        engine.abort(job)
        raise
    return response


def _usage(job: GenerationRequest, completion_tokens: int) -> dict[str, Any]:
    return usage_body(job.prompt_tokens, completion_tokens, job.cached_tokens)
