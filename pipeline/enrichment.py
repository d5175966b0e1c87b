"""Turns a prompt request into exactly one result record: an insight, or an error that says why.

This is the one place where the pipeline meets the model. It never raises for a failed or malformed
answer (the stream must not stop); it returns an ``EnrichmentError`` that sinks store and count. The
answer is checked inside the client (``validate=parse_understanding``), so an answer that is not a
``ShopperUnderstanding`` is tried once more on another replica and counts against the replica that
sent it, instead of becoming an error record while a healthy replica stands by.
"""

from __future__ import annotations

import time

import orjson
from pydantic import BaseModel, Field, ValidationError

from llm_client.client import LLMClient
from llm_client.errors import InvalidAnswer, LLMError
from prompt_assembly.records import EnrichmentError, EnrichmentResult, PromptRequest, ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding, response_format


class EnrichmentSettings(BaseModel):
    max_tokens: int = Field(200, ge=16, description="output budget; answers are ~200 tokens")
    deadline_s: float = Field(30.0, gt=0, description="per prompt, retries included")
    guided_json: bool = Field(True, description="send the JSON schema as response_format")


class Enricher:
    def __init__(self, client: LLMClient, settings: EnrichmentSettings | None = None) -> None:
        self.client = client
        self.settings = settings or EnrichmentSettings()

    async def enrich(self, prompt: PromptRequest) -> EnrichmentResult:
        try:
            completion = await self.client.chat(
                prompt.messages,
                routing_key=prompt.shopper_id,
                max_tokens=self.settings.max_tokens,
                response_format=response_format() if self.settings.guided_json else None,
                deadline_s=self.settings.deadline_s,
                prompt_tokens=prompt.prompt_tokens,
                validate=parse_understanding,
            )
        except InvalidAnswer as exc:
            return self._error(prompt, "InvalidAnswer", str(exc), exc.attempts, exc.raw)
        except LLMError as exc:
            return self._error(prompt, type(exc).__name__, str(exc), attempts=exc.attempts)
        understanding = completion.parsed
        assert isinstance(understanding, ShopperUnderstanding)  # what parse_understanding returns
        return ShopperInsight(
            request_id=prompt.request_id,
            shopper_id=prompt.shopper_id,
            session_epoch=prompt.session_epoch,
            seq=prompt.seq,
            reason=prompt.reason,
            understanding=understanding,
            text=understanding.summary,
            model=completion.model,
            replica=completion.endpoint,
            usage=Usage(
                prompt_tokens=completion.prompt_tokens,
                cached_tokens=completion.cached_tokens,
                completion_tokens=completion.completion_tokens,
            ),
            event_count=prompt.event_count,
            new_event_ids=prompt.new_event_ids,
            last_event_ts=prompt.last_event_ts,
            ttft_ms=completion.ttft_ms,
            latency_ms=completion.latency_ms,
            attempts=completion.attempts,
            produced_at=time.time(),
        )

    @staticmethod
    def _error(
        prompt: PromptRequest, error_type: str, message: str, attempts: int, raw: str | None = None
    ) -> EnrichmentError:
        return EnrichmentError(
            request_id=prompt.request_id,
            shopper_id=prompt.shopper_id,
            session_epoch=prompt.session_epoch,
            seq=prompt.seq,
            reason=prompt.reason,
            error_type=error_type,
            message=message[:500],
            attempts=attempts,
            new_event_ids=prompt.new_event_ids,
            last_event_ts=prompt.last_event_ts,
            produced_at=time.time(),
            raw_answer=None if raw is None else raw[:2000],
        )


def parse_understanding(text: str) -> ShopperUnderstanding:
    """Validate a model answer; tolerates a fenced code block around the JSON (small models do that).
    Raises ``InvalidAnswer`` (kind ``schema``)."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`")
        body = body.split("\n", 1)[1] if "\n" in body else body
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end <= start:
        raise InvalidAnswer(f"answer holds no JSON object: {text[:120]!r}", kind="schema", raw=text)
    try:
        return ShopperUnderstanding.model_validate(orjson.loads(body[start : end + 1]))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        message = f"answer is not a valid ShopperUnderstanding: {exc}"
        raise InvalidAnswer(message, kind="schema", raw=text) from None
