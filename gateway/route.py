"""From an incoming OpenAI request to the routing policy's view of it (pure, no I/O).

The body is read, never rewritten: the replica receives the caller's bytes. What the policy needs is
taken from them:

- the routing key (the shopper): the ``x-session-id`` header (configurable), else the body's ``user``
  field (OpenAI's end-user id, which SDKs and Flink's OpenAI provider can set), else a key unique to
  the request, so a caller that names no shopper gets no affinity rather than one hot replica;
- the prompt as the replica's prefix cache sees it: chat messages flattened exactly as
  ``LLMClient.chat`` and the simulator flatten them (text parts of multi-part messages only), or the
  completion prompt, so the block hashes of both paths agree;
- the decode budget (``max_completion_tokens`` / ``max_tokens``) for load accounting.

Fields that only the serving side may write are refused (400), never passed on (``SERVER_ONLY_FIELDS``):
a caller's ``disaggregated_params`` would make a decode replica pull KV blocks from any URL it names
(a request from inside the serving network: SSRF) or pull another request's pinned blocks by guessing
its sequential ``ctx_request_id``; vLLM's ``kv_transfer_params`` carry a remote host and port the same
way; a caller's ``cache_salt`` would choose which tenant's KV cache its prompt may reuse.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_client.routing import RouteRequest
from prompt_assembly.errors import ShopperError
from prompt_assembly.tokens import messages_text
from prompt_assembly.validation import first_problem

CHARS_PER_TOKEN = 4
"""The client's own prompt-size estimate (``LLMClient.chat``): load accounting, not billing."""

SERVER_ONLY_FIELDS = {
    "disaggregated_params": "the P/D hand-over between replicas (TensorRT-LLM) is the gateway's own",
    "kv_transfer_params": "the P/D hand-over between replicas (vLLM) is the gateway's own",
    "cache_salt": "KV-cache isolation between tenants is set by the serving side, not by callers",
}
"""Request fields a caller may not send, and why (the 400's message)."""


class InvalidRequest(ShopperError, ValueError):
    """The body cannot be routed (not JSON, not an object, wrong field types): answered 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_KEY_CHARS = 256
"""The longest routing key, session or ``Idempotency-Key`` a caller may send: the gateway keeps them
(session claims, answers kept for a repeat, affinity), so their size is bounded as their number is."""
MAX_DECODE_TOKENS = 1 << 20
"""The largest ``max_tokens`` taken: load accounting adds it to a replica's outstanding decode work."""

DecodeTokens = Annotated[int, Field(ge=1, le=MAX_DECODE_TOKENS)]


class RoutingView(BaseModel):
    """The fields of a chat or completion request that routing reads; everything else is ignored
    here and passed on untouched."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] | None = None
    prompt: str | list[Any] | None = None
    user: Annotated[str, Field(max_length=MAX_KEY_CHARS)] | None = None
    max_tokens: DecodeTokens | None = None
    max_completion_tokens: DecodeTokens | None = None
    stream: bool | None = None

    def prompt_text(self) -> str:
        """The text the replica will cache, as routing hashes it. Only strings and token ids are read:
        ``str()`` of a caller's nested JSON would recurse as deep as the caller nested it."""
        if self.messages is not None:
            return messages_text([{"role": _role(m), "content": _text(m)} for m in self.messages])
        if isinstance(self.prompt, list):
            return _first_prompt(self.prompt)
        return self.prompt or ""


def _role(message: Mapping[str, Any]) -> str:
    role = message.get("role", "user")
    return role if isinstance(role, str) else ""


def _first_prompt(prompt: list[Any]) -> str:
    """A completion's first prompt: a string, or token ids (one list of them, or a batch of lists)."""
    if not prompt:
        return ""
    first = prompt[0]
    if isinstance(first, str):
        return first
    tokens = first if isinstance(first, list) else prompt
    return " ".join(str(t) for t in tokens if isinstance(t, int))


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            text
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(text := part.get("text"), str)
        )
    return ""


def route_for(
    body: bytes, headers: Mapping[str, str], *, key_header: str, default_max_tokens: int
) -> RouteRequest:
    """The policy's view of one request; raises ``InvalidRequest`` when the body cannot be routed."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidRequest("request body must be a JSON object")
    for name, why in SERVER_ONLY_FIELDS.items():
        if name in document:
            raise InvalidRequest(f"{name} may not be sent to this gateway: {why}", name)
    try:
        view = RoutingView.model_validate(document)
    except ValidationError as exc:
        param, message = first_problem(exc)
        raise InvalidRequest(f"{param}: {message}", param) from None
    key = bounded_key(headers.get(key_header), key_header) or view.user or f"anonymous-{uuid.uuid4().hex}"
    text = view.prompt_text()
    max_tokens = view.max_completion_tokens or view.max_tokens or default_max_tokens
    return RouteRequest(key, text, len(text) // CHARS_PER_TOKEN, max_tokens)


def bounded_key(value: str | None, header: str) -> str | None:
    """A caller's key header as it came; None when it is absent, empty or only whitespace (every caller
    sending an empty ``Idempotency-Key`` would otherwise share one key: a 422 for another body, another
    caller's answer for the same one); a 400 when it is longer than ``MAX_KEY_CHARS``."""
    if value is None or not value.strip():
        return None
    if len(value) > MAX_KEY_CHARS:
        raise InvalidRequest(f"{header} may be at most {MAX_KEY_CHARS} characters, not {len(value)}", header)
    return value


def models_route() -> RouteRequest:
    """``GET /v1/models``: no prompt, no decode work; any routable replica may answer."""
    return RouteRequest(f"models-{uuid.uuid4().hex}", "", 0, 0)
