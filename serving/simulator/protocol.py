"""The OpenAI-compatible wire format: validated request models and response/chunk bodies.

Requests accept the fields our client and common OpenAI clients send, including trtllm's extensions
(``ignore_eos``, ``min_tokens``, ``cache_salt``, ``response_format`` of type ``json``); unknown fields are
ignored rather than rejected (trtllm-serve rejects them: its request models forbid extra fields).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prompt_assembly.tokens import messages_text


class ContentPart(BaseModel):
    """One part of a multi-part message; only text parts contribute to the prompt."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class StreamOptions(BaseModel):
    """``include_usage`` defaults to true, as in trtllm-serve (OpenAI requires the field)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = True
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    """OpenAI ``text`` / ``json_object`` / ``json_schema``, plus trtllm's ``json`` with ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema", "json"]
    json_schema: dict[str, Any] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        if self.type == "json" and self.schema_ is None:
            raise ValueError("response_format.schema is required when type is 'json'")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


RequestType = Literal["context_only", "generation_only", "context_and_generation"]


class DisaggregatedParams(BaseModel):
    """TensorRT-LLM's ``disaggregated_params`` (``tensorrt_llm.disaggregated_params``): what the
    disaggregated front end adds to a request for the context server (``context_only``), what the
    context server answers with, and what it passes on to the generation server (``generation_only``).
    ``opaque_state`` is engine-specific (base64); the simulator's is ``serving.simulator.disagg.OpaqueState``.
    """

    model_config = ConfigDict(extra="ignore")
    request_type: RequestType
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: str | None = None
    draft_tokens: list[int] | None = None

    @model_validator(mode="after")
    def _generation_needs_the_context(self) -> DisaggregatedParams:
        if self.request_type == "generation_only":
            if not self.first_gen_tokens:
                raise ValueError("generation_only needs first_gen_tokens from the context server")
            if not self.opaque_state:
                raise ValueError("generation_only needs opaque_state from the context server")
        return self


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request, like our client")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    user: str | None = None
    disaggregated_params: DisaggregatedParams | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("cache_salt must be a non-empty string if provided")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens

    def response_format_dict(self) -> dict[str, Any] | None:
        return self.response_format.as_dict() if self.response_format else None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_text(self) -> str:
        return messages_text([{"role": m.role, "content": m.text()} for m in self.messages])

    def last_user_text(self) -> str:
        for message in reversed(self.messages):
            if message.role == "user":
                return message.text()
        return self.messages[-1].text()


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def last_user_text(self) -> str:
        return self.prompt_text()


Endpoint = Literal["chat", "completion"]


class KvPullRequest(BaseModel):
    """Body of a context replica's ``POST /internal/kv_transfer``: which finished prompt, and which of
    its blocks the generation replica lacks (it already holds the others)."""

    model_config = ConfigDict(extra="ignore")
    ctx_request_id: int
    block_hashes: list[int] = Field(default_factory=list)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    endpoint: Endpoint,
    response_id: str,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
    disaggregated_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The non-streaming response of either endpoint (a context server's carries
    ``disaggregated_params`` in its choice, as trtllm-serve's does)."""
    choice: dict[str, Any]
    if endpoint == "chat":
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    if disaggregated_params is not None:
        choice["disaggregated_params"] = disaggregated_params
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk_body(
    endpoint: Endpoint,
    response_id: str,
    model: str,
    *,
    text: str | None,
    first: bool = False,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    with_choice: bool = True,
) -> dict[str, Any]:
    """One SSE chunk; ``with_choice=False`` gives the trailing usage-only chunk (``choices: []``)."""
    choices: list[dict[str, Any]] = []
    if with_choice:
        if endpoint == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's ``{"error": {...}}`` shape, with trtllm-serve's flat fields beside it, so a client
    written against either server finds what it reads."""
    return {
        "error": {"message": message, "type": error_type, "param": param, "code": code},
        "object": "error",
        "message": message,
        "type": error_type,
        "code": code,
    }
