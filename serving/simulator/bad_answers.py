"""What a broken replica can send with a 200: the simulator's bad-answer fault (``bad_answer``).

A replica is untrusted input to the pipeline (a bad build, a broken chat template, a proxy's error page
in front of it, a runaway generation). Each kind here is one way of failing *after* the status line,
so the client's limits, parsing and the answer-health quarantine are tested against a real HTTP server
(the fault suite runs one such replica among healthy ones, on both engines):

- ``huge``: a few megabytes (one 6 MB stream line, or a 6 MB JSON body);
- ``wrong_types``: the OpenAI shape with the wrong types (content a number, choices a string);
- ``not_json``: an HTML error page with status 200;
- ``empty``: a 200 with no body at all;
- ``not_understanding``: a well-formed completion whose text is not the JSON the caller asked for;
- ``too_deep``: a completion with a field nested 50,000 deep, past what a recursive decoder takes
  (msgspec raised ``RecursionError``, which no ``except`` for its own errors caught);
- ``mixed``: each bad answer one of the above, drawn at random;
- ``off_schema``: a shopper understanding in every other respect, with a field the schema does not
  allow and without one it requires, which a lenient model of the answer would let through (not in
  ``mixed``: only a caller that holds answers to the schema refuses it).

Nothing is computed for a bad answer: the engine never sees the request, as with a replica whose
serving layer is what is broken.
"""

from __future__ import annotations

from typing import Literal

import orjson
from aiohttp import web

BadAnswer = Literal[
    "none", "huge", "wrong_types", "not_json", "empty", "not_understanding", "too_deep", "mixed", "off_schema"
]
BAD_ANSWERS: tuple[BadAnswer, ...] = (
    "huge", "wrong_types", "not_json", "empty", "not_understanding", "too_deep"
)  # fmt: skip

_HUGE_BYTES = 6 * 1024 * 1024
TOO_DEEP = 50_000
"""Past any recursion limit a decoder has: Python 3.11's 1,000 frames, and the C limit of later ones."""
_REFUSAL = "I'm sorry, but I can't help with describing this shopper."
OFF_SCHEMA_ANSWER = {
    "interests": ["costumes"],
    "style": "playful",
    "price_sensitivity": "medium",
    "summary": "Looks for fun costumes.",
    "budget": "under $50",
}
"""``off_schema``'s text: ``occasion`` missing, ``budget`` not in the schema."""


def _completion(text: object, *, stream: bool) -> dict[str, object]:
    if stream:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
    }


def bad_answer_body(kind: BadAnswer, *, stream: bool) -> tuple[bytes, str]:
    """The body and content type of one bad answer of ``kind``."""
    if kind == "not_json":
        return b"<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"
    if kind == "empty":
        return b"", "application/json"
    if kind == "huge":
        document: object = _completion("x" * _HUGE_BYTES, stream=stream)
    elif kind == "wrong_types":
        document = (
            {"choices": [{"delta": {"content": 42}}], "usage": {"prompt_tokens": "many"}}
            if stream
            else {"choices": "none", "usage": {"prompt_tokens": [1]}}
        )
    elif kind == "off_schema":
        document = _completion(orjson.dumps(OFF_SCHEMA_ANSWER).decode(), stream=stream)
    else:
        document = _completion(_REFUSAL, stream=stream)
    payload = orjson.dumps(document)
    if kind == "too_deep":  # written by hand: orjson writes no deeper than 255
        payload = payload[:-1] + b',"extra":' + b"[" * TOO_DEEP + b"]" * TOO_DEEP + b"}"
    if stream:
        return b"data: " + payload + b"\n\ndata: [DONE]\n\n", "text/event-stream"
    return payload, "application/json"


def bad_answer_response(kind: BadAnswer, *, stream: bool) -> web.Response:
    body, content_type = bad_answer_body(kind, stream=stream)
    return web.Response(body=body, status=200, content_type=content_type)
