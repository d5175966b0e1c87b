"""Property-based fuzzing of the event gate and the dead-letter record (hypothesis).

The gate (``parse_event``) meets whatever a producer puts on the topic: arbitrary bytes, deep nesting,
huge numbers, NaN/Infinity, control and bidi characters, valid events with one field replaced by
anything. For every input it must return a valid event or raise ``MalformedEvent`` with a short reason,
and never anything else; the dead letter built from any rejected input must stay bounded and readable.
A hang shows up as the file's timeout. Example counts are bounded to keep the file to a few seconds.
"""

from __future__ import annotations

import json
import string
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.dead_letter import MAX_REASON_CHARS, DeadLetter, dead_letter
from prompt_assembly.events import MAX_EVENT_BYTES, MalformedEvent, ShopperEvent, parse_event

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID: dict[str, Any] = {
    "event_id": "e-1",
    "shopper_id": "s-1",
    "type": "view",
    "ts": 1_760_000_000.0,
    "product": {"product_id": "p-1", "title": "Witch Costume", "price": 19.99, "snippet": "fun"},
}

BIDI_AND_CONTROL = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c" + "".join(
    chr(c) for c in [*range(0, 32), 127, 0x85, 0x2028, 0x2029, 0xFEFF]
)
hostile_text = st.text(
    alphabet=st.one_of(st.sampled_from(BIDI_AND_CONTROL), st.characters(), st.sampled_from('<>/"\\{}[]')),
    max_size=400,
)
huge_numbers = st.one_of(
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), huge_numbers, hostile_text),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(hostile_text, children, max_size=5)
    ),
    max_leaves=30,
)


def _check_gate(raw: bytes) -> ShopperEvent | MalformedEvent:
    """The gate's contract for one input; returns what it did."""
    try:
        event = parse_event(raw)
    except MalformedEvent as exc:
        assert isinstance(exc.reason, str) and exc.reason.strip()
        assert len(exc.reason) <= MAX_REASON_CHARS, "a reason is short enough to keep whole"
        _check_dead_letter(raw, exc.reason)
        return exc
    assert isinstance(event, ShopperEvent)
    assert parse_event(event.to_json()) == event, "an accepted event survives its own round trip"
    return event


def _check_dead_letter(raw: bytes, reason: str, max_original_bytes: int = 64 * 1024) -> None:
    letter = dead_letter(raw, reason, topic="shopper-events", partition=3, offset=2**62, timestamp_ms=1)
    encoded = letter.to_bytes()
    bound = 6 * (max_original_bytes + MAX_REASON_CHARS) + 2048
    assert len(encoded) <= bound
    again = DeadLetter.from_bytes(encoded)
    assert again == letter and again.original_size == len(raw)


def _dump(value: Any) -> bytes:
    """JSON text for any value: NaN/Infinity, 400-digit integers and lone surrogates included."""
    if isinstance(value, float) and value != value:
        return b"NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return b"Infinity" if value > 0 else b"-Infinity"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    if isinstance(value, list):
        return b"[" + b",".join(_dump(v) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b",".join(_dump(str(k)) + b":" + _dump(v) for k, v in value.items()) + b"}"
    # json (not orjson) so that lone surrogates become "\\ud800" escapes, as a hostile producer can send
    return json.dumps(value).encode()


@FUZZ
@given(st.binary(max_size=MAX_EVENT_BYTES + 64))
@example(b"")
@example(b"\xff\xfe\x00{")
@example(b"{" * 5000)
@example(b"[" * 8000 + b"]" * 8000)
@example(b'{"a":' * 3000 + b"1" + b"}" * 3000)
def test_gate_on_arbitrary_bytes(raw: bytes) -> None:
    _check_gate(raw)


@FUZZ
@given(json_values)
def test_gate_on_arbitrary_json(value: Any) -> None:
    _check_gate(_dump(value))


@FUZZ
@given(
    field=st.sampled_from(
        ["event_id", "shopper_id", "type", "ts", "product", "query", "quantity", "schema_version"]
    ),
    value=json_values,
    nested=st.sampled_from(["product_id", "title", "brand", "category", "price", "snippet"]),
    nested_value=json_values,
)
def test_gate_on_a_valid_event_with_fields_replaced(
    field: str, value: Any, nested: str, nested_value: Any
) -> None:
    record = {**VALID, field: value}
    _check_gate(_dump(record))
    product = {**VALID["product"], nested: nested_value}
    _check_gate(_dump({**VALID, "product": product}))


@FUZZ
@given(title=hostile_text.filter(lambda t: 0 < len(t) <= 200), number=huge_numbers)
@example(title="\u202eemutsoc hctiw", number=float("nan"))
@example(title="ok", number=10**400)
def test_text_with_control_and_bidi_characters_is_accepted_or_named(title: str, number: Any) -> None:
    record = {**VALID, "product": {**VALID["product"], "title": title, "price": number}}
    outcome = _check_gate(_dump(record))
    if isinstance(outcome, ShopperEvent):
        assert outcome.product is not None and outcome.product.title == title
        assert 0 <= outcome.product.price <= 1_000_000


@pytest.mark.parametrize(
    "raw",
    [
        b'{"ts": NaN}',
        b'{"ts": Infinity}',
        b'{"ts": 1e999999}',
        b'{"ts": ' + b"9" * 5000 + b"}",
        b'{"quantity": -' + b"9" * 5000 + b"}",
        orjson.dumps({**VALID, "ts": None}).replace(b"null", b"NaN"),
        orjson.dumps(VALID).replace(b"19.99", b"Infinity"),
        orjson.dumps(VALID).replace(b"19.99", b"1" + b"0" * 400),
        orjson.dumps(VALID).replace(b"Witch Costume", b"Witch \\ud800 Costume"),  # a lone surrogate
        orjson.dumps(VALID).replace(b"s-1", b"\\udfff"),
    ],
)
def test_non_finite_huge_numbers_and_lone_surrogates_are_rejected_with_a_reason(raw: bytes) -> None:
    with pytest.raises(MalformedEvent) as caught:
        parse_event(raw)
    assert caught.value.reason
    _check_dead_letter(raw, caught.value.reason)


@settings(max_examples=60, deadline=None)
@given(
    value=st.one_of(
        st.none(),
        st.binary(max_size=300_000),
        st.text(alphabet=BIDI_AND_CONTROL, max_size=200_000).map(str.encode),
    ),
    reason=st.text(max_size=5000),
    max_original_bytes=st.sampled_from([0, 1, 1000, 64 * 1024]),
)
def test_dead_letter_is_bounded_for_any_input(
    value: bytes | None, reason: str, max_original_bytes: int
) -> None:
    """Any value (binary, up to 300 KB of escaped control characters) and any reason (up to 5,000
    characters) give a dead letter within ``6 x (max_original_bytes + MAX_REASON_CHARS)`` bytes."""
    letter = dead_letter(value, reason, topic="t", max_original_bytes=max_original_bytes)
    encoded = letter.to_bytes()
    assert len(encoded) <= 6 * (max_original_bytes + MAX_REASON_CHARS) + 2048
    assert len(letter.reason) <= MAX_REASON_CHARS
    assert DeadLetter.from_bytes(encoded) == letter
    if value is not None:
        assert letter.original_size == len(value) and letter.original_sha256 is not None
        assert letter.truncated == (len(value) > max_original_bytes)


def test_printable_garbage_is_not_silently_accepted() -> None:
    """The fuzzers above can only pass if rejection is real: a sample of printable junk is rejected."""
    for junk in (string.printable.encode(), b"null", b"[]", b"{}", b'"view"', b"1e3"):
        with pytest.raises(MalformedEvent):
            parse_event(junk)
