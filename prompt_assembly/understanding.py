"""The structured answer we ask the model for, and its JSON schema for guided decoding.

The schema goes to the server as ``response_format`` (trtllm-serve: guided decoding; llama-server: a
grammar built from it); the answer is then validated with this model, so a malformed answer becomes an
error record instead of a bad value in the cache that ad servers read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PriceSensitivity = Literal["low", "medium", "high"]


class ShopperUnderstanding(BaseModel):
    model_config = ConfigDict(extra="ignore")

    interests: Annotated[list[Annotated[str, Field(max_length=60)]], Field(min_length=1, max_length=5)]
    occasion: Annotated[str, Field(max_length=80)] | None = None
    style: Annotated[str, Field(max_length=80)]
    price_sensitivity: PriceSensitivity
    summary: Annotated[str, Field(min_length=1, max_length=240)]


def understanding_json_schema() -> dict[str, Any]:
    """A compact JSON schema (no $defs) that both trtllm-serve and llama-server can compile."""
    return {
        "type": "object",
        "properties": {
            "interests": {
                "type": "array",
                "items": {"type": "string", "maxLength": 60},
                "minItems": 1,
                "maxItems": 5,
            },
            "occasion": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]},
            "style": {"type": "string", "maxLength": 80},
            "price_sensitivity": {"type": "string", "enum": ["low", "medium", "high"]},
            "summary": {"type": "string", "minLength": 1, "maxLength": 240},
        },
        "required": ["interests", "occasion", "style", "price_sensitivity", "summary"],
        "additionalProperties": False,
    }


def response_format() -> dict[str, Any]:
    """OpenAI ``response_format`` asking for a ``ShopperUnderstanding``."""
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "shopper_understanding",
            "schema": understanding_json_schema(),
            "strict": True,
        },
    }
