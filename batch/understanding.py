"""The structured answer the batch job asks for per product, and its JSON schema for guided decoding.

Product understanding answers "which shoppers would love this item, for what, in what style": the
signals that the real-time matcher reads back from Redis next to a shopper's own understanding. The
schema goes to the server as ``response_format``; the answer is validated with this model, so a
malformed answer becomes an error row instead of a bad value in the cache.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_client.answer_text import json_object_text, schema_field_errors
from llm_client.errors import InvalidAnswer

PriceTier = Literal["budget", "mid", "premium"]


class ProductUnderstanding(BaseModel):
    model_config = ConfigDict(extra="ignore")

    segments: Annotated[list[Annotated[str, Field(max_length=60)]], Field(min_length=1, max_length=4)]
    """Shopper segments that would love this item ("parents of school-age kids")."""
    occasions: Annotated[list[Annotated[str, Field(max_length=60)]], Field(max_length=3)] = []
    style: Annotated[str, Field(max_length=60)]
    price_tier: PriceTier
    summary: Annotated[str, Field(min_length=1, max_length=200)]


def product_json_schema() -> dict[str, Any]:
    """A compact schema (no $defs) that trtllm-serve and llama-server can compile."""
    phrase = {"type": "string", "maxLength": 60}
    return {
        "type": "object",
        "properties": {
            "segments": {"type": "array", "items": phrase, "minItems": 1, "maxItems": 4},
            "occasions": {"type": "array", "items": phrase, "minItems": 0, "maxItems": 3},
            "style": phrase,
            "price_tier": {"type": "string", "enum": ["budget", "mid", "premium"]},
            "summary": {"type": "string", "minLength": 1, "maxLength": 200},
        },
        "required": ["segments", "occasions", "style", "price_tier", "summary"],
        "additionalProperties": False,
    }


PRODUCT_SCHEMA = product_json_schema()
"""What every answer is asked to be and held to (``parse_product_understanding``: extra and missing
fields too, which the lenient model lets through)."""


def product_response_format() -> dict[str, Any]:
    """OpenAI ``response_format`` asking for a ``ProductUnderstanding``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "product_understanding", "schema": product_json_schema(), "strict": True},
    }


def parse_product_understanding(text: str, *, schema_sent: bool = True) -> ProductUnderstanding:
    """Validate a model answer against the schema it was asked for (every field present, no other,
    each of its type and within its limits); a fenced code block around the JSON is tolerated. Without
    ``schema_sent`` (``guided_json`` off) the field names are the model's to judge: an extra one is
    ignored and missing ``occasions`` are none.

    Raises ``InvalidAnswer`` (kind ``schema``) with the reason, which the job records for the product;
    the client calls it on every answer (``validate=``), so a bad one is tried once more elsewhere.
    """
    body = json_object_text(text)
    if body is None:
        raise InvalidAnswer(f"answer holds no JSON object: {text[:120]!r}", kind="schema", raw=text)
    try:
        answer = orjson.loads(body)
        errors = schema_field_errors(answer, PRODUCT_SCHEMA) if schema_sent else []
        if not errors:
            return ProductUnderstanding.model_validate(answer)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        errors = [str(exc)]
    message = f"answer is not a valid ProductUnderstanding: {'; '.join(errors)}"
    raise InvalidAnswer(message, kind="schema", raw=text)


def parse_unguided_product_understanding(text: str) -> ProductUnderstanding:
    """``parse_product_understanding`` for an answer asked for without a schema (``guided_json`` off)."""
    return parse_product_understanding(text, schema_sent=False)
