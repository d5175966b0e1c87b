"""The gate's two tiers agree with pydantic on every input: the fast tier (msgspec) may only accept what
pydantic accepts, and must build the very same models (fields, fields set, nested product); every
rejection, and its reason, is pydantic's. Differential tests on hand-picked edge cases and on fuzzed
events (hypothesis)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.synthetic import SyntheticStream
from prompt_assembly import events
from prompt_assembly.events import MalformedEvent, ProductSnapshot, ShopperEvent, parse_event

BASE: dict[str, Any] = {
    "event_id": "e-1",
    "shopper_id": "s-1",
    "type": "view",
    "ts": 1_761_800_000.5,
    "product": {"product_id": "p-1", "title": "Witch Costume", "price": 19.99},
}


def _reference(raw: bytes) -> ShopperEvent | str:
    """What pydantic says (the event, or the rejection reason), and the rules the gate adds: two for
    what Flink's JSON functions cannot read (``NaN`` and ``Infinity`` are not JSON numbers, RFC 8259,
    and no number is longer than 1,000 characters, wherever they are), and no control character in an
    event id (``EVENT_ID_CONTROL_REASON``). The fuzzer found the oracle lacked the last one."""
    try:
        event = events._EVENT.validate_json(raw)
    except pydantic.ValidationError as exc:
        return events.describe_validation_error(exc)
    literals: list[str] = []
    numbers: list[int] = [0]
    json.loads(
        raw,
        parse_constant=literals.append,
        parse_int=lambda n: numbers.append(len(n)),
        parse_float=lambda n: numbers.append(len(n)),
    )
    if literals:
        return f"invalid JSON: {literals[0]} is not a JSON number (RFC 8259)"
    longest = max(numbers)
    if longest > 1000:
        readers = "JSON readers such as Flink's accept"
        return f"invalid JSON: a number of {longest} characters, over the 1000 that {readers}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in event.event_id):  # the gate's id rule (6 Dec)
        return events.EVENT_ID_CONTROL_REASON
    return event


def _assert_same_as_pydantic(raw: bytes) -> None:
    expected = _reference(raw)
    try:
        got: ShopperEvent | str = parse_event(raw)
    except MalformedEvent as exc:
        got = exc.reason
    if isinstance(expected, str):
        assert got == expected, "a rejection and its reason are pydantic's"
        return
    assert isinstance(got, ShopperEvent)
    assert got == expected
    assert got.model_dump() == expected.model_dump()
    assert got.model_fields_set == expected.model_fields_set
    assert (got.__pydantic_extra__, got.__pydantic_private__) == (None, None)
    if expected.product is not None:
        assert isinstance(got.product, ProductSnapshot)
        assert got.product.model_fields_set == expected.product.model_fields_set
    assert orjson.dumps(got.model_dump()) == orjson.dumps(expected.model_dump())


def _raw(record: dict[str, Any], **changes: Any) -> bytes:
    return orjson.dumps({**record, **changes})


EDGE_CASES = [
    _raw(BASE),
    _raw(BASE, type="search", query="witch", product=None),
    _raw(BASE, type="search", query=""),
    _raw(BASE, type="search", query="witch", product=BASE["product"]),
    _raw({k: v for k, v in BASE.items() if k != "product"}),
    _raw(BASE, product=None),
    _raw(BASE, quantity=1.0),  # pydantic's lax mode takes an integral float: pydantic decides
    _raw(BASE, quantity=True),
    _raw(BASE, quantity="2"),
    _raw(BASE, ts="1761800000"),
    _raw(BASE, ts=1_761_800_000),
    _raw(BASE, schema_version=1),
    _raw(BASE, schema_version=2),
    _raw(BASE, extra={"nested": [1, 2, {"x": None}]}),
    _raw(BASE, product={**BASE["product"], "brand": "", "snippet": "x" * 600}),
    _raw(BASE, product={**BASE["product"], "snippet": "x" * 601}),
    _raw(BASE, product={**BASE["product"], "title": "\U0001f600" * 200}),
    _raw(BASE, product={**BASE["product"], "title": "\U0001f600" * 201}),
    _raw(BASE, product={**BASE["product"], "price": -0.0}),
    _raw(BASE, product={**BASE["product"], "price": 1_000_000}),
    _raw(BASE, product={**BASE["product"], "price": 1_000_000.0000001}),
    b'{"type":"teleport",' + _raw(BASE)[1:],  # duplicate key: the last one counts
    _raw(BASE)[:-1] + b',"type":"teleport"}',
    _raw(BASE)[:-1] + b',"event_id":"e-2"}',
    _raw(BASE).replace(b"Witch Costume", b"\\ud800"),  # lone surrogate
    _raw(BASE).replace(b"Witch Costume", b"\\ud83d\\ude00"),
    _raw(BASE).replace(b"Witch Costume", b"\xff"),
    _raw(BASE).replace(b"Witch Costume", b"\xed\xa0\x80"),
    _raw(BASE).replace(b"19.99", b"1" + b"0" * 400),
    _raw(BASE).replace(b"19.99", b"NaN"),
    _raw(BASE)[:-1] + b',"x":NaN}',
    _raw(BASE)[:-1] + b',"x":' + b"[" * 3000 + b"]" * 3000 + b"}",
    # In a field the mirror skips unchecked, where pydantic checks every byte (the mirror accepted these):
    _raw(BASE)[:-1] + b',"x":' + b"[" * 995 + b"]" * 995 + b"}",  # and msgspec's limit moved with the stack
    _raw(BASE)[:-1] + b',"x":' + b"[" * 201 + b"]" * 201 + b"}",
    _raw(BASE)[:-1] + b',"x":' + b"[" * 70 + b"]" * 70 + b"}",
    _raw(BASE)[:-1] + b',"x":"\xff"}',
    _raw(BASE)[:-1] + b',"x":"\xed\xa0\x80"}',
    _raw(BASE)[:-1] + b',"x":"\xc0\xaf"}',
    _raw(BASE)[:-1] + b',"x":' + b"9" * 5000 + b"}",
    _raw(BASE)[:-1] + b',"x":' + b"9" * 4300 + b"}",
    # Number literals past the 1,000 characters Flink's JSON_VALUE reads (Jackson), and just within:
    _raw(BASE)[:-1] + b',"x":' + b"9" * 1001 + b"}",
    _raw(BASE)[:-1] + b',"x":' + b"9" * 1000 + b"}",
    _raw(BASE)[:-1] + b',"x":-' + b"9" * 999 + b"}",
    _raw(BASE)[:-1] + b',"x":1.' + b"0" * 1199 + b"}",
    _raw(BASE)[:-1] + b',"x":1.' + b"5" * 500 + b"e" + b"7" * 500 + b"}",
    _raw(BASE)[:-1] + b',"x":"' + b"9" * 1500 + b'"}',  # a string of digits is no number
    _raw(BASE)[:-1] + b',"x":[' + b",".join([b"9" * 900] * 3) + b"]}",
    _raw(BASE)[:-1] + ',"x":"h\u00e9llo \U0001f600"}'.encode(),
    b"\xef\xbb\xbf" + _raw(BASE),
    b" \n" + _raw(BASE) + b" \n",
    _raw(BASE) + b"x",
    _raw(BASE).replace(b'"event_id"', b'"\\u0065vent_id"'),
    b"[]",
    b"{}",
    b"null",
    b"",
]


@pytest.mark.parametrize("raw", EDGE_CASES)
def test_edge_cases_match_pydantic(raw: bytes) -> None:
    _assert_same_as_pydantic(raw)


def test_the_synthetic_stream_matches_pydantic_and_takes_the_fast_tier() -> None:
    records = SyntheticStream(shoppers=50, seed=5, malformed_rate=0.05).take(2000)
    fast = 0
    for _, value, _ in records:
        _assert_same_as_pydantic(value)
        fast += events._fast_tier(value) is not None
    assert fast >= 0.9 * len(records), "well-formed events should not need the pydantic tier"


def test_the_mirror_has_the_schema_fields() -> None:
    assert set(events._WireEvent.__struct_fields__) == set(ShopperEvent.model_fields)
    assert set(events._WireProduct.__struct_fields__) == set(ProductSnapshot.model_fields)


text = st.one_of(st.text(max_size=40), st.text(max_size=700), st.sampled_from(["", "x" * 200, "x" * 201]))
numbers = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -0.0, 1000, 1001, 1_000_000, 1e10, 1_761_800_000.5]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
FIELD_VALUES = {
    "event_id": scalars,
    "shopper_id": scalars,
    "type": st.one_of(st.sampled_from(["view", "click", "add_to_cart", "purchase", "search"]), scalars),
    "ts": scalars,
    "query": scalars,
    "quantity": scalars,
    "schema_version": scalars,
}
PRODUCT_VALUES = {
    "product_id": scalars,
    "title": scalars,
    "brand": scalars,
    "category": scalars,
    "price": scalars,
    "snippet": scalars,
}


@st.composite
def mutated_events(draw: st.DrawFn) -> bytes:
    record: dict[str, Any] = {**BASE, "product": dict(BASE["product"])}
    for name in draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=3)):
        record[name] = draw(FIELD_VALUES[name])
    for name in draw(st.sets(st.sampled_from(sorted(PRODUCT_VALUES)), max_size=2)):
        record["product"][name] = draw(PRODUCT_VALUES[name])
    for name in draw(st.sets(st.sampled_from([*FIELD_VALUES, "product"]), max_size=2)):
        record.pop(name, None)
    if draw(st.booleans()):
        record["product"] = draw(st.one_of(st.none(), scalars, st.just(record.get("product"))))
    return json.dumps(record).encode()  # json, not orjson: lone surrogates stay escapes


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_events())
def test_fuzzed_events_match_pydantic(raw: bytes) -> None:
    _assert_same_as_pydantic(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_match_pydantic(raw: bytes) -> None:
    _assert_same_as_pydantic(raw)
