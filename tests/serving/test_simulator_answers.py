"""Stand-in answers: deterministic, length-controlled, and JSON that validates against the schema."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from serving.simulator.answers import plan_answer

PROMPT = "<|user|>\nShopper viewed Nike Air Zoom Pegasus, then Garmin Forerunner watches in Running Gear.\n"
USER = "Shopper viewed Nike Air Zoom Pegasus, then Garmin Forerunner watches in Running Gear."


class Interest(BaseModel):
    category: str = Field(max_length=40)
    brands: list[str] = Field(default_factory=list, max_length=3)
    confidence: float = Field(ge=0.0, le=1.0)


class ShopperProfile(BaseModel):
    intent: Literal["browse", "compare", "buy"]
    interests: list[Interest] = Field(min_length=1, max_length=4)
    budget_eur: int | None = Field(default=None, ge=10, le=5000)
    summary: str = Field(max_length=200)
    returning: bool
    tags: list[str] = Field(default_factory=list, json_schema_extra={"uniqueItems": True})


SCHEMAS: dict[str, dict[str, Any]] = {
    "pydantic_nested_refs": ShopperProfile.model_json_schema(),
    "hand_written": {
        "type": "object",
        "properties": {
            "top_products": {"type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 2},
            "segment": {"type": ["string", "null"], "enum": ["runner", "hiker", None]},
            "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "visits": {"type": "integer", "minimum": 1, "maximum": 3, "multipleOf": 1},
            "when": {"type": "string", "format": "date-time"},
            "kind": {"const": "profile"},
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                "items": False,
            },
            "meta": {
                "allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]
            },
            "choice": {"oneOf": [{"type": "integer", "minimum": 5}, {"type": "null"}]},
        },
        "required": ["top_products", "score", "visits", "kind", "pair", "meta"],
        "additionalProperties": False,
    },
    "bare_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": -1},
        "maxItems": 2,
    },
}


def _rf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_same_prompt_same_answer_and_words_come_from_the_prompt() -> None:
    a = plan_answer(PROMPT, USER, max_tokens=200)
    b = plan_answer(PROMPT, USER, max_tokens=200)
    assert a == b
    assert "".join(a.pieces) == a.text
    assert {"Nike", "Garmin", "Pegasus"} & set(a.text.replace(".", " ").split())
    assert plan_answer(PROMPT + "x", USER, max_tokens=200).text != a.text


def test_max_tokens_caps_plain_text_with_finish_reason_length() -> None:
    answer = plan_answer(PROMPT, USER, max_tokens=5)
    assert answer.completion_tokens == 5 and answer.finish_reason == "length"


def test_ignore_eos_and_min_tokens() -> None:
    assert plan_answer(PROMPT, USER, max_tokens=333, ignore_eos=True).completion_tokens == 333
    assert plan_answer(PROMPT, USER, max_tokens=2000, min_tokens=1500).completion_tokens >= 1500


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("max_tokens", [1000, 40])
def test_json_schema_answers_validate(name: str, max_tokens: int) -> None:
    schema = SCHEMAS[name]
    answer = plan_answer(PROMPT, USER, max_tokens=max_tokens, response_format=_rf(schema))
    jsonschema.validate(json.loads(answer.text), schema)
    assert answer.finish_reason == "stop"
    assert answer.completion_tokens <= max_tokens
    assert "".join(answer.pieces) == answer.text


def test_pydantic_schema_round_trips_and_uses_prompt_words() -> None:
    answer = plan_answer(
        PROMPT, USER, max_tokens=1000, response_format=_rf(ShopperProfile.model_json_schema())
    )
    profile = ShopperProfile.model_validate_json(answer.text)
    words = {"Nike", "Air", "Zoom", "Pegasus", "Garmin", "Forerunner", "Running", "Gear", "Shopper"}
    assert set(profile.interests[0].category.split()) <= words


def test_trtllm_json_format_and_json_object() -> None:
    schema = SCHEMAS["bare_array"]
    answer = plan_answer(PROMPT, USER, max_tokens=100, response_format={"type": "json", "schema": schema})
    jsonschema.validate(json.loads(answer.text), schema)
    free = plan_answer(PROMPT, USER, max_tokens=100, response_format={"type": "json_object"})
    assert isinstance(json.loads(free.text), dict)


def test_json_too_long_for_max_tokens_stays_valid_and_usage_is_capped() -> None:
    items = {"type": "array", "items": {"type": "string"}, "minItems": 30}
    schema = {"type": "object", "properties": {"items": items}, "required": ["items"]}
    answer = plan_answer(PROMPT, USER, max_tokens=10, response_format=_rf(schema))
    jsonschema.validate(json.loads(answer.text), schema)
    assert answer.completion_tokens == 10 and len(answer.pieces) > 10


def test_the_shopper_understanding_is_read_from_the_activity_log() -> None:
    from prompt_assembly.understanding import ShopperUnderstanding, response_format
    from serving.simulator.shopper_answer import STAND_IN_LABEL

    log = (
        "Shopper s1: activity log, oldest first.\n"
        "- 2025-10-20 18:01 viewed: <data>Witch Costume Set</data> by Rubie's, Costumes > Kids, $24.00\n"
        "- 2025-10-20 18:03 viewed: <data>Unicorn Dress-Up Kit</data>, Costumes > Kids, $19.50\n"
        "- 2025-10-20 18:04 searched <data>witch hat</data>\n"
        "- 2025-10-20 18:06 added to cart: <data>Witch Costume Set</data>, Costumes > Kids, $24.00\n"
        "- 2025-10-20 18:07 viewed: <data>Gummy Worms Party Bag 5lb</data>, Candy > Bulk, $12.00\n"
        "Task: describe this shopper from the activity log above. Answer with the JSON object only."
    )
    answer = plan_answer(log, log, 200, response_format())
    understanding = ShopperUnderstanding.model_validate_json(answer.text)
    assert understanding.interests[0] == "kid costumes"
    assert understanding.occasion is not None and "child" in understanding.occasion
    assert understanding.price_sensitivity == "medium"
    assert understanding.summary.endswith(STAND_IN_LABEL)
    assert plan_answer(log, log, 200, response_format()).text == answer.text  # deterministic
