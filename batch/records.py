"""Input and output rows of a batch job, in an OpenAI-batch-like JSONL shape.

Input, one product per line::

    {"custom_id": "prod-1", "method": "POST", "url": "/v1/product-understanding",
     "body": {"product_id": "B0001", "title": "...", "brand": "...", "category": "...", "price": 24.99,
              "text": "description and long-form content", "reviews": ["...", "..."]}}

``method`` and ``url`` may be left out; ``product_id`` defaults to ``custom_id``. Output rows mirror
OpenAI's batch output (``custom_id``, ``response.status_code``, ``response.body``, ``error``) plus the
input line number, which is what makes a row's place (its shard, hence its part object) deterministic.
A bad line never stops a job: it becomes an error row whose ``reason`` says what to fix.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from batch.errors import BatchError
from batch.understanding import ProductUnderstanding
from prompt_assembly.prompt import block_text, inline_text
from prompt_assembly.validation import first_problem

PRODUCT_UNDERSTANDING_URL: Final = "/v1/product-understanding"

ErrorReason = Literal["unparseable", "invalid", "empty", "oversized", "llm_failed", "invalid_answer"]


class BadRecord(BatchError):
    """A line that cannot be processed; ``reason`` is one of ``ErrorReason``."""

    def __init__(self, reason: ErrorReason, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: ErrorReason = reason
        self.message = message
        self.custom_id = custom_id


def _no_bool(value: Any) -> Any:
    """``true`` is no price: pydantic's lax mode read it as 1.0 (a string of digits stays a price)."""
    if isinstance(value, bool):
        raise ValueError("a number, not true or false")
    return value


class ProductBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    product_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    title: Annotated[str, Field(max_length=1000)] = ""
    brand: Annotated[str, Field(max_length=200)] | None = None
    category: Annotated[str, Field(max_length=300)] | None = None
    price: Annotated[float, Field(ge=0), BeforeValidator(_no_bool)] | None = None
    text: str = ""
    reviews: list[str] = []


class BatchInputLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    custom_id: Annotated[str, Field(min_length=1, max_length=200)]
    method: Literal["POST"] = "POST"
    url: Literal["/v1/product-understanding"] = PRODUCT_UNDERSTANDING_URL
    body: ProductBody


class ProductRecord(BaseModel):
    """A parsed, non-empty product, ready to be planned into prompts."""

    model_config = ConfigDict(frozen=True)

    line: int
    custom_id: str
    product_id: str
    title: str
    brand: str | None
    category: str | None
    price: float | None
    document: str
    """Description, long-form content and reviews, in that order: what may be split."""


_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"([^"\\]{1,200})"')
_LONG_SPACE = re.compile(r"\s{17,}")
"""A run of whitespace past 16 characters: a real tokenizer pays for every one, the stand-in counts a
run as one token, so megabytes of spaces passed the prompt budget."""


def _cut_space(run: re.Match[str]) -> str:
    """The run's first 16 characters, and a line break if the rest held one (the next line stays a
    line of its own)."""
    text = run[0]
    return text[:16] + ("\n" if "\n" in text[16:] else "")


def parse_line(line: int, raw: bytes) -> ProductRecord:
    """Parse one input line; raises ``BadRecord`` (unparseable, invalid or empty)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # Name the record if its id can still be read, so the submitter can find it.
        found = _CUSTOM_ID.search(raw)
        custom_id = found.group(1).decode(errors="replace") if found else None
        raise BadRecord("unparseable", f"not JSON: {exc}", custom_id) from None
    if not isinstance(data, dict):
        raise BadRecord("unparseable", f"a line must be a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) else None
    try:
        parsed = BatchInputLine.model_validate(data)
    except ValidationError as exc:
        where, message = first_problem(exc)
        raise BadRecord("invalid", f"{where or 'line'}: {message}", custom_id) from None
    body = parsed.body
    parts = [body.text.strip()] + [f"Review: {r.strip()}" for r in body.reviews if r.strip()]
    document = _LONG_SPACE.sub(_cut_space, "\n\n".join(p for p in parts if p))
    title = body.title.strip()
    if not inline_text(title).strip() and not block_text(document).strip():  # as the model would see them
        raise BadRecord("empty", "the product has neither a title nor any text", parsed.custom_id)
    return ProductRecord(
        line=line,
        custom_id=parsed.custom_id,
        product_id=body.product_id or parsed.custom_id,
        title=title,
        brand=body.brand,
        category=body.category,
        price=body.price,
        document=document,
    )


def output_row(
    job_id: str,
    record: ProductRecord,
    understanding: ProductUnderstanding,
    *,
    parts: int,
    model: str,
    usage: dict[str, int],
) -> dict[str, Any]:
    """One line of an output part (OpenAI batch output shape)."""
    return {
        "id": f"{job_id}-{record.line}",
        "custom_id": record.custom_id,
        "line": record.line,
        "response": {
            "status_code": 200,
            "body": {
                "product_id": record.product_id,
                "title": record.title,
                "understanding": understanding.model_dump(mode="json"),
                "parts": parts,
                "model": model,
                "usage": usage,
            },
        },
        "error": None,
    }


def error_row(
    job_id: str, line: int, reason: ErrorReason, message: str, custom_id: str | None
) -> dict[str, Any]:
    """One line of an errors file: what was wrong with which input line."""
    return {
        "id": f"{job_id}-{line}",
        "custom_id": custom_id,
        "line": line,
        "response": None,
        "error": {"reason": reason, "message": message[:500]},
    }
