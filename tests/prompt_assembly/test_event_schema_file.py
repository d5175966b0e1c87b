"""The event schema producers read (docs/event.schema.json) is the one generated from the model, and
it agrees with the gate: what the synthetic producer sends validates, and what the schema accepts the
gate accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import (
    JSON_SCHEMA_PATH,
    MAX_EVENT_BYTES,
    MalformedEvent,
    event_json_schema,
    event_json_schema_text,
    parse_event,
)

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = (
    ".venv/bin/python -c 'from prompt_assembly.events import event_json_schema_text as t; "
    f'print(t(), end="")\' > {JSON_SCHEMA_PATH}'
)
VALIDATOR = Draft202012Validator(event_json_schema())


def test_the_committed_schema_is_the_generated_one() -> None:
    committed = (ROOT / JSON_SCHEMA_PATH).read_text()
    assert committed == event_json_schema_text(), f"regenerate it: {REGENERATE}"
    Draft202012Validator.check_schema(orjson.loads(committed))


def test_every_event_the_synthetic_producer_sends_validates() -> None:
    records = SyntheticStream(shoppers=40, seed=5, malformed_rate=0.05).take(2000)
    valid = [value for _, value, malformed in records if not malformed]
    for value in valid:
        errors = [e.message for e in VALIDATOR.iter_errors(orjson.loads(value))]
        assert errors == [], value
    # What the schema refuses, the gate refuses too (the schema is never laxer than the gate).
    for _, value, malformed in records:
        if not malformed or len(value) > MAX_EVENT_BYTES:
            continue
        try:
            document = orjson.loads(value)
        except orjson.JSONDecodeError:
            continue
        if VALIDATOR.is_valid(document):
            parse_event(value)  # raises if the gate disagrees


PRODUCT = {"product_id": "p-1", "title": "Witch Hat", "price": 9.5}
BASE = {"event_id": "e-1", "shopper_id": "s-1", "type": "view", "ts": 1_764_000_000.5, "product": PRODUCT}


@pytest.mark.parametrize(
    "change",
    [
        {"product": None},
        {"type": "search", "product": None},
        {"type": "search", "query": ""},
        {"ts": "yesterday"},
        {"product": {**PRODUCT, "price": -1}},
        {"product": {**PRODUCT, "title": "x" * 201}},
        {"type": "wishlist"},
        {"event_id": "e-\x01"},
        {"event_id": "e-\x7f"},
    ],
)
def test_the_schema_and_the_gate_refuse_the_same_events(change: dict[str, Any]) -> None:
    document = {**BASE, **change}
    assert not VALIDATOR.is_valid(document)
    with pytest.raises(MalformedEvent):
        parse_event(orjson.dumps(document))


def test_fields_the_schema_does_not_name_are_allowed() -> None:
    document = {**BASE, "utm_source": "newsletter", "product": {**PRODUCT, "gtin": "0123"}}
    assert VALIDATOR.is_valid(document)
    assert parse_event(orjson.dumps(document)).event_id == "e-1"
