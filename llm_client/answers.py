"""A replica's answer, read as untrusted input: bytes in, a ``Completion`` or an ``InvalidAnswer`` out.

A replica is a process we do not control (an ageing GPU, a bad deployment, a proxy's error page), so
nothing it sends is trusted:

- size: a body or a stream is read in chunks and abandoned past ``AnswerLimits.max_answer_bytes``
  (``AnswerTooLarge``); one stream line past ``max_line_bytes`` likewise. A declared ``Content-Length``
  over the limit is refused before a byte is read. Nothing is buffered beyond the limits;
- shape and types: each document is decoded straight into typed ``msgspec`` structs (the OpenAI
  chat-completion schema, with llama-server's ``timings``), so a wrong type is an ``InvalidAnswer``
  naming the field, never a ``TypeError`` or ``AttributeError`` further on;
- an ``error`` event inside a 200 stream is the replica failing the request (``EndpointUnavailable``),
  except a gateway's ``superseded`` one, which is its 409 sent after the status line (``SupersededByNewer``).

This module and ``llm_client.transport.mapped_transport_errors`` are the only places where what a
replica sends becomes one of the client's errors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
from pydantic import BaseModel, Field

from llm_client.errors import (
    AnswerTooLarge,
    EndpointUnavailable,
    InvalidAnswer,
    InvalidAnswerKind,
    LLMError,
    SupersededByNewer,
)
from llm_client.models import Completion


class AnswerLimits(BaseModel):
    """Bounds on what one answer may make the client read (``LLM_ANSWER_LIMITS__*``)."""

    max_answer_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="whole body or stream; a 200-token answer streams ~40 KB, a 4k-token batch one ~1 MB",
    )
    max_line_bytes: int = Field(
        256 * 1024, ge=256, description="one server-sent-event line (one chunk of a stream)"
    )


# ---- the OpenAI chat-completion schema, as far as the client reads it ---------------------------------
class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Timings(msgspec.Struct):
    """llama-server: ``prompt_n`` tokens computed, ``cache_n`` reused from its prompt cache."""

    cache_n: int = 0
    prompt_n: int = 0
    predicted_n: int = 0


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message | None = None
    text: str | None = None
    finish_reason: str | None = None
    disaggregated_params: dict[str, Any] | None = None
    """A P/D context server's hand-over (TensorRT-LLM: ``first_gen_tokens``, ``ctx_request_id``,
    ``opaque_state``), passed on unread to the generation server."""


class _Body(msgspec.Struct):
    choices: list[_Choice]
    model: str = ""
    usage: _Usage | None = None
    timings: _Timings | None = None


class _Delta(msgspec.Struct):
    content: str | None = None


class _StreamChoice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_StreamChoice] = []
    model: str | None = None
    usage: _Usage | None = None
    timings: _Timings | None = None
    error: msgspec.Raw = msgspec.Raw()
    """An ``error`` event's object, undecoded; empty when the event has none. Not ``Raw | None``: msgspec
    0.23 takes that union for ``null`` alone, so every error event failed to decode, and the client
    judged a replica's (or a gateway's) error event a malformed answer (``wrong_shape``)."""


_BODY = msgspec.json.Decoder(_Body)
_CHUNK = msgspec.json.Decoder(_Chunk)


class _StreamError(msgspec.Struct):
    type: str | None = None
    superseded_by: str | None = None


_STREAM_ERROR = msgspec.json.Decoder(_StreamError)


def _stream_error(raw: bytes, endpoint: str) -> LLMError:
    """An ``error`` event inside a 200 stream: the replica failing the request (``EndpointUnavailable``),
    or a gateway ending a stream a newer version of its session superseded (``SupersededByNewer``, as its
    409 says before the status line), which counts against nobody."""
    detail = _text(raw)[:300]
    try:
        error = _STREAM_ERROR.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        error = _StreamError()
    if error.type == "superseded" and error.superseded_by:
        return SupersededByNewer(
            f"superseded in stream: {detail}", newer_version=error.superseded_by, endpoint=endpoint
        )
    return EndpointUnavailable(f"error in stream: {detail}", endpoint=endpoint)


def usage_counts(usage: _Usage | None, timings: _Timings | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from OpenAI ``usage``, completed by llama-server ``timings``."""
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None
    if timings is not None:
        cached = timings.cache_n if cached is None else cached
        prompt = prompt or timings.cache_n + timings.prompt_n
        completion = completion or timings.predicted_n
    return prompt, cached or 0, completion


def usage_from_documents(usage: object, timings: object) -> tuple[int, int, int]:
    """``usage_counts`` for already-decoded JSON (the gateway's tap); a wrong shape counts as nothing."""
    try:
        return usage_counts(msgspec.convert(usage, _Usage | None), msgspec.convert(timings, _Timings | None))
    except msgspec.ValidationError:
        return 0, 0, 0


def chunk_problem(payload: bytes) -> str | None:
    """Why one stream event's payload is not a completion chunk as ``read_stream`` decodes it (the
    gateway's tap asks this of a stream's first event), or None when it is one."""
    try:
        _CHUNK.decode(payload)
    except RecursionError:
        return "nested too deeply to decode"
    except msgspec.MsgspecError as exc:
        return str(exc)
    return None


def _invalid(exc: msgspec.MsgspecError | RecursionError, raw: bytes, endpoint: str) -> InvalidAnswer:
    if isinstance(exc, RecursionError):
        return InvalidAnswer(
            "answer is nested too deeply to decode", kind="wrong_shape", endpoint=endpoint, raw=_text(raw)
        )
    if isinstance(exc, msgspec.ValidationError):
        return InvalidAnswer(
            f"answer has the wrong shape: {exc}", kind="wrong_shape", endpoint=endpoint, raw=_text(raw)
        )
    kind: InvalidAnswerKind = "empty" if not raw.strip() else "not_json"
    return InvalidAnswer(f"answer is not JSON: {exc}", kind=kind, endpoint=endpoint, raw=_text(raw))


def _text(raw: bytes) -> str:
    return raw[:2000].decode("utf-8", "replace")


async def read_body(response: aiohttp.ClientResponse, limits: AnswerLimits, endpoint: str) -> bytes:
    """The whole body, refused past ``max_answer_bytes`` (declared or read)."""
    limit = limits.max_answer_bytes
    if response.content_length is not None and response.content_length > limit:
        raise AnswerTooLarge(
            f"answer declares {response.content_length} bytes, over the {limit}-byte limit", endpoint=endpoint
        )
    parts: list[bytes] = []
    size = 0
    async for data in response.content.iter_any():
        size += len(data)
        if size > limit:
            raise AnswerTooLarge(f"answer passed the {limit}-byte limit", endpoint=endpoint)
        parts.append(data)
    return b"".join(parts)


def parse_body(raw: bytes, endpoint: str, started: float) -> Completion:
    """A non-streamed chat (or text) completion."""
    try:
        body = _BODY.decode(raw)
    except (msgspec.MsgspecError, RecursionError) as exc:  # msgspec recurses on nesting ~1000 deep
        raise _invalid(exc, raw, endpoint) from None
    if not body.choices:
        raise InvalidAnswer("answer has no choices", kind="wrong_shape", endpoint=endpoint, raw=_text(raw))
    choice = body.choices[0]
    text = choice.message.content if choice.message is not None else choice.text
    prompt, cached, completion_tokens = usage_counts(body.usage, body.timings)
    latency = (time.perf_counter() - started) * 1000
    return Completion(
        text=text or "",
        model=body.model,
        endpoint=endpoint,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion_tokens,
        ttft_ms=latency,
        latency_ms=latency,
        attempts=1,
        finish_reason=choice.finish_reason,
        disaggregated_params=choice.disaggregated_params,
    )


async def sse_lines(
    response: aiohttp.ClientResponse, limits: AnswerLimits, endpoint: str
) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event stream, up to ``data: [DONE]`` or the end.

    Lines are split here (not by aiohttp's ``readline``, whose own limit raises its internal
    ``LineTooLong``), so both limits hold and raise ``AnswerTooLarge``: every line, complete or not, is
    held to ``max_line_bytes`` (a complete oversized line inside one read passed before). Each byte is
    copied once (``LineSplitter``): re-joining the unfinished line on every read made a replica that
    streams megabytes without a newline cost time quadratic in them."""
    total = 0
    lines = LineSplitter(limits.max_line_bytes)
    async for data in response.content.iter_any():
        total += len(data)
        if total > limits.max_answer_bytes:
            raise AnswerTooLarge(f"stream passed the {limits.max_answer_bytes}-byte limit", endpoint=endpoint)
        for line in lines.feed(data):
            if line is None:
                raise AnswerTooLarge(
                    f"stream line passed the {limits.max_line_bytes}-byte limit", endpoint=endpoint
                )
            payload = _payload(line)
            if payload == b"[DONE]":
                return
            if payload is not None:
                yield payload
    payload = _payload(lines.rest())
    if payload is not None and payload != b"[DONE]":
        yield payload


class LineSplitter:
    """Splits a byte stream into ``\n``-ended lines, copying each byte once, holding at most
    ``max_line_bytes`` of an unfinished line. A line over the limit comes out as None (once, when it
    passes the limit); its remaining bytes are skipped up to its end."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._pieces: list[bytes] = []
        self._size = 0
        self._skipping = False

    @property
    def buffered(self) -> int:
        """Bytes held of the unfinished line (never more than ``max_line_bytes``)."""
        return self._size

    def feed(self, data: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            if self._skipping:
                self._skipping = False
            elif self._size + end - start > self.max_line_bytes:
                out.append(None)
            elif self._pieces:
                self._pieces.append(data[start:end])
                out.append(b"".join(self._pieces))
            else:
                out.append(data[start:end])
            self._pieces.clear()
            self._size = 0
            start = end + 1
        if start < len(data) and not self._skipping:
            if self._size + len(data) - start > self.max_line_bytes:
                out.append(None)
                self._pieces.clear()
                self._size = 0
                self._skipping = True
            else:
                self._pieces.append(data[start:] if start else data)
                self._size += len(data) - start
        return out

    def rest(self) -> bytes:
        """The unfinished last line (a stream may end without a newline)."""
        line = b"".join(self._pieces)
        self._pieces.clear()
        self._size = 0
        return line


def _payload(line: bytes) -> bytes | None:
    line = line.strip()
    return line[5:].strip() if line.startswith(b"data:") else None


async def read_stream(
    response: aiohttp.ClientResponse,
    limits: AnswerLimits,
    endpoint: str,
    started: float,
    on_first_token: Callable[[], None] | None = None,
) -> Completion:
    """A streamed chat (or text) completion; ``on_first_token`` is called at its first content token."""
    parts: list[str] = []
    ttft_ms: float | None = None
    usage: _Usage | None = None
    timings: _Timings | None = None
    model = ""
    finish: str | None = None
    chunks = 0
    last_piece_at: float | None = None
    max_gap = 0.0
    async for payload in sse_lines(response, limits, endpoint):
        try:
            chunk = _CHUNK.decode(payload)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise _invalid(exc, payload, endpoint) from None
        if chunk.error and bytes(chunk.error) != b"null":
            raise _stream_error(bytes(chunk.error), endpoint)
        chunks += 1
        model = chunk.model or model
        usage = chunk.usage or usage
        timings = chunk.timings or timings
        for choice in chunk.choices:
            piece = choice.delta.content if choice.delta is not None else choice.text
            if piece:
                now = time.perf_counter()
                if ttft_ms is None:
                    ttft_ms = (now - started) * 1000
                    if on_first_token is not None:
                        on_first_token()
                elif last_piece_at is not None:
                    max_gap = max(max_gap, now - last_piece_at)
                last_piece_at = now
                parts.append(piece)
            finish = choice.finish_reason or finish
    if chunks == 0:
        raise InvalidAnswer("stream held no completion chunk", kind="empty", endpoint=endpoint)
    latency = (time.perf_counter() - started) * 1000
    prompt, cached, completion_tokens = usage_counts(usage, timings)
    return Completion(
        text="".join(parts),
        model=model,
        endpoint=endpoint,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion_tokens,
        ttft_ms=latency if ttft_ms is None else ttft_ms,
        latency_ms=latency,
        attempts=1,
        finish_reason=finish,
        max_itl_ms=max_gap * 1000 if len(parts) > 1 else None,
    )


# ---- the caller's verdict ---------------------------------------------------------------------------
AnswerValidator = Callable[[str], object]
"""Checks an answer's text and returns what the caller wants of it (kept as ``Completion.parsed``);
raises ``InvalidAnswer`` (kind ``schema``) when the text is not what the caller's schema requires."""


def validated(validate: AnswerValidator, completion: Completion, endpoint: str) -> object:
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
