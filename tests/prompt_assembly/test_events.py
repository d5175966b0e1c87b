"""The event gate: valid events parse; each kind of malformed input is rejected with a clear reason."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import MAX_EVENT_BYTES, MalformedEvent, ShopperEvent, parse_event

VALID = {
    "event_id": "e-1",
    "shopper_id": "s-1",
    "type": "add_to_cart",
    "ts": 1_761_800_000.5,
    "product": {
        "product_id": "p-1",
        "title": "Witch Costume",
        "brand": "Spooky",
        "category": "Costumes",
        "price": 24.99,
    },
}


def test_valid_event_round_trips() -> None:
    event = parse_event(orjson.dumps(VALID))
    assert event.product is not None and event.product.price == 24.99
    assert parse_event(event.to_json()) == event


@pytest.mark.parametrize(
    ("raw", "reason_part"),
    [
        (b"{not json", "invalid JSON"),
        (None, "null value"),
        (orjson.dumps({**VALID, "ts": "yesterday"}), "ts"),
        (orjson.dumps({k: v for k, v in VALID.items() if k != "shopper_id"}), "shopper_id"),
        (orjson.dumps({**VALID, "type": "teleport"}), "type"),
        (orjson.dumps({**VALID, "product": {**VALID["product"], "title": "x" * 201}}), "product.title"),  # type: ignore[dict-item]
        (orjson.dumps({**VALID, "product": {**VALID["product"], "price": -1}}), "product.price"),  # type: ignore[dict-item]
        (orjson.dumps({**VALID, "product": None}), "needs a 'product'"),
        (orjson.dumps({**VALID, "type": "search", "product": None}), "needs a non-empty 'query'"),
        (orjson.dumps({**VALID, "schema_version": 99}), "schema_version"),
        (b"[1, 2]", "object"),
        (b"x" * (MAX_EVENT_BYTES + 1), "byte limit"),
    ],
)
def test_malformed_input_is_rejected_with_a_reason(raw: bytes | None, reason_part: str) -> None:
    with pytest.raises(MalformedEvent) as info:
        parse_event(raw)
    assert reason_part in info.value.reason


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_other_errors(raw: bytes) -> None:
    try:
        assert isinstance(parse_event(raw), ShopperEvent)
    except MalformedEvent as exc:
        assert exc.reason


def test_synthetic_stream_marks_exactly_the_malformed_records() -> None:
    records = SyntheticStream(shoppers=50, seed=3, malformed_rate=0.05).take(3000)
    for _, value, malformed in records:
        if malformed:
            with pytest.raises(MalformedEvent):
                parse_event(value)
        else:
            parse_event(value)
    assert 50 < sum(m for *_, m in records) < 250


def test_synthetic_stream_is_deterministic_and_skewed() -> None:
    first = SyntheticStream(shoppers=100, seed=11).take(5000)
    assert first == SyntheticStream(shoppers=100, seed=11).take(5000)
    counts: dict[bytes, int] = {}
    for key, _, _ in first:
        counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 3 * ranked[len(ranked) // 2], "activity should be Zipf-like: a few hot shoppers"
