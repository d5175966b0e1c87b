"""A replica's answer handed over unread: what ``LLMClient.forward`` yields to a proxy.

The bytes reach the caller exactly as the replica sent them, chunk by chunk as they arrive. On the way a
tap reads just enough of them for the routing policy and the health detector to learn what they learn
from a parsed answer: when the first body byte came (the time to first token of a stream), the usage
(prompt, cached and completion tokens, or llama-server's ``timings``) and an ``error`` event inside a
stream. Only lines that mention ``usage``, ``timings`` or ``error`` are decoded, so the tap costs a
substring search per chunk; a stream's first event is also decoded as the in-process client decodes
every one (``answers.chunk_problem``), so that a replica streaming the wrong shape is found.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from llm_client.answers import AnswerLimits, LineSplitter, chunk_problem
from llm_client.endpoints import Endpoint
from llm_client.errors import AnswerTooLarge
from llm_client.transport import mapped_transport_errors

_INTERESTING = (b'"usage"', b'"timings"', b'"error"')
_DONE_LINE_MAX = 16  # ``data: [DONE]`` with room for spacing and a line end
_LIST_FIELDS = ("choices", "data")
ANSWER_HEAD_BYTES = 2000
"""How much of a whole body a bad answer's error record keeps."""


@dataclass(slots=True)
class UsageTap:
    """Reads usage and errors from an answer's bytes without changing or holding up any of them.

    A stream's lines are split copying each byte once (``LineSplitter``), and at most ``max_line_bytes``
    of an unfinished line are held: a line longer than that (no usage line is) is passed on to the
    caller but not read. Re-joining the unfinished line on every read made a replica that streams MiBs
    without a newline block the gateway's event loop for seconds (0.4 s at 1 MiB, 1.5 s at 2 MiB)."""

    streaming: bool
    max_line_bytes: int = AnswerLimits().max_line_bytes
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False
    """A stream's ``data: [DONE]`` line was read: the answer is whole, whatever comes after it."""
    not_json: str | None = None
    """A whole body (not streamed) that is not JSON: why (``orjson``'s message)."""
    blank: bool = False
    """... and it held nothing but white space."""
    lists: dict[str, int] = field(default_factory=dict)
    """A whole body's top-level ``choices`` and ``data``, where they are lists: their lengths. With
    ``not_json`` and ``head``, what ``forwarding.answer_problem`` judges, from the one parse that
    reads the usage (it parsed the body a second time before)."""
    head: bytes = b""
    """A whole body's first ``ANSWER_HEAD_BYTES`` (a stream's first event's), for a bad answer's error
    record."""
    events: int = 0
    """A stream's ``data:`` events other than ``[DONE]``: one with none held no answer."""
    bad_event: str | None = None
    """Why a stream's first event is not a completion chunk (``answers.chunk_problem``)."""
    _lines: LineSplitter | None = None
    _body: list[bytes] = field(default_factory=list)

    @property
    def buffered(self) -> int:
        """Bytes held of a stream's unfinished line."""
        return 0 if self._lines is None else self._lines.buffered

    def feed(self, data: bytes) -> None:
        if not self.streaming:
            self._body.append(data)  # one JSON document, read when it is complete
            return
        if self._lines is None:
            self._lines = LineSplitter(self.max_line_bytes)
        for line in self._lines.feed(data):
            if line is None or not line.startswith(b"data:"):
                continue
            if len(line) <= _DONE_LINE_MAX and line[5:].strip() == b"[DONE]":
                self.done = True
                continue
            self._event(line)
            if any(word in line for word in _INTERESTING):
                self._read(line[5:].strip())

    def finish(self) -> None:
        if self.streaming:
            tail = b"" if self._lines is None else self._lines.rest()
            if not tail.startswith(b"data:"):
                return
            if tail[5:].strip() == b"[DONE]":  # the last line without its line end
                self.done = True
                return
            self._event(tail)
            self._read(tail[5:].strip())
        else:
            body = b"".join(self._body)
            self._body.clear()
            self._read_body(body)

    def _event(self, line: bytes) -> None:
        self.events += 1
        if self.events == 1:
            payload = line[5:].strip()
            self.head = payload[:ANSWER_HEAD_BYTES]
            self.bad_event = chunk_problem(payload)

    def _read_body(self, body: bytes) -> None:
        self.head = body[:ANSWER_HEAD_BYTES]
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            self.not_json, self.blank = str(exc), not body.strip()
            return  # the caller gets it as it is
        if not isinstance(document, dict):
            return
        self.usage = document.get("usage") or self.usage
        self.timings = document.get("timings") or self.timings
        self.lists = {
            name: len(value) for name in _LIST_FIELDS if isinstance(value := document.get(name), list)
        }

    def _read(self, payload: bytes) -> None:
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return  # ``[DONE]``, or a body that is not JSON: the caller gets it as it is
        if not isinstance(document, dict):
            return
        self.usage = document.get("usage") or self.usage
        self.timings = document.get("timings") or self.timings
        if self.streaming and document.get("error"):
            self.error = str(document["error"])[:300]


@dataclass(slots=True)
class Forwarded:
    """One replica's answer (status and headers read, body not yet) and the load it holds there.

    The replica's share of load accounting (outstanding requests, prefill and decode tokens) is held
    until ``release``; the prefill share is given back at the first body byte, as a streamed call does
    at its first token. ``chunks`` may be iterated once.
    """

    endpoint: Endpoint
    route_max_tokens: int
    prefill_tokens: int
    max_bytes: int = 4 * 1024 * 1024
    """The answer is cut off (``AnswerTooLarge``) past this many bytes (``AnswerLimits``)."""
    max_line_bytes: int = AnswerLimits().max_line_bytes
    """The longest stream line the usage tap reads (``AnswerLimits``); longer ones pass unread."""
    started: float = field(default_factory=time.perf_counter)
    response: aiohttp.ClientResponse | None = None
    attempts: int = 1
    tap: UsageTap = field(default_factory=lambda: UsageTap(streaming=False))
    on_prefill_done: Callable[[bool], None] | None = None
    """Told once: ``True`` at the first byte of the answer (the replica's iteration holding this prefill
    is over), ``False`` if the attempt ends without one (nothing known computed)."""
    on_release: Callable[[], None] | None = None
    """Told once, when the attempt is over (``release``)."""
    first_byte_ms: float | None = None
    finished_ms: float | None = None
    """Set when the body was read to its end (``None``: the caller stopped early or it broke off)."""
    _released: bool = False

    def hold(self) -> None:
        self.endpoint.outstanding += 1
        self.endpoint.outstanding_prefill_tokens += self.prefill_tokens
        self.endpoint.outstanding_decode_tokens += self.route_max_tokens

    def _prefill_done(self, *, computed: bool) -> None:
        self.endpoint.outstanding_prefill_tokens -= self.prefill_tokens
        self.prefill_tokens = 0
        callback, self.on_prefill_done = self.on_prefill_done, None
        if callback is not None:
            callback(computed)

    def release(self) -> None:
        """Give the replica's load back and close the answer (a connection not read to its end is
        closed, so the replica stops generating for nobody). Idempotent."""
        if self._released:
            return
        self._released = True
        self.endpoint.outstanding -= 1
        self._prefill_done(computed=False)  # a no-op if the first byte came
        self.endpoint.outstanding_decode_tokens -= self.route_max_tokens
        if self.on_release is not None:
            self.on_release()
        if self.response is not None:
            if self.finished_ms is None:
                self.response.close()
            else:
                self.response.release()

    @property
    def status(self) -> int:
        assert self.response is not None
        return self.response.status

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        assert self.response is not None
        return self.response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, unchanged, up to a stream's ``data: [DONE]`` (the read that holds it
        is the last: the answer is whole, and waiting for the replica to close held the caller's
        slot and its load, and blamed the replica for a stall or a reset after its answer). A replica
        that breaks off, stalls past the attempt timeout or sends more than ``max_bytes`` raises
        ``ConnectionFailed``, ``AttemptTimeout`` or ``AnswerTooLarge`` (nothing can be retried by
        then); the bytes before it were passed on."""
        assert self.response is not None
        streaming = self.response.content_type == "text/event-stream"
        self.tap = UsageTap(streaming=streaming, max_line_bytes=self.max_line_bytes)
        size = 0
        with mapped_transport_errors(self.endpoint.name):
            async for data in self.response.content.iter_any():
                if self.first_byte_ms is None:
                    self.first_byte_ms = (time.perf_counter() - self.started) * 1000
                    self._prefill_done(computed=True)
                size += len(data)
                if size > self.max_bytes:
                    raise AnswerTooLarge(
                        f"answer passed the {self.max_bytes}-byte limit", endpoint=self.endpoint.name
                    )
                self.tap.feed(data)
                yield data
                if self.tap.done:
                    break
        self.tap.finish()
        self.finished_ms = (time.perf_counter() - self.started) * 1000

    async def read(self) -> bytes:
        """The whole body (for answers that are not streamed)."""
        return b"".join([chunk async for chunk in self.chunks()])
