"""The session store writes what ``SessionEntry.to_json`` writes, byte for byte: its own encoder of a
stored event (``runner.session_store.stored_json``) equals ``prompt_assembly.session.stored_event`` on
the synthetic stream and on fuzzed events, and a save's one argument per shopper splits back into the
entries exactly (``joined_entries``)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import MalformedEvent, ShopperEvent, parse_event
from prompt_assembly.session import SessionEntry, stored_event
from runner.session_store import ENTRY_SEPARATOR, joined_entries, stored_json


def test_the_synthetic_stream_is_stored_as_stored_event_writes_it() -> None:
    checked = 0
    for _, value, _ in SyntheticStream(shoppers=30, seed=3, malformed_rate=0.05).take(3000):
        try:
            event = parse_event(value)
        except MalformedEvent:
            continue
        assert stored_json(event) == stored_event(event)
        checked += 1
    assert checked > 2500


def test_joined_entries_split_back_into_to_json() -> None:
    events = [parse_event(v) for _, v, bad in SyntheticStream(shoppers=5, seed=4).take(50) if not bad]
    entries = [SessionEntry(i % 3, i, event) for i, event in enumerate(events)]
    expected = [SessionEntry(e.segment, e.arrival, e.event).to_json() for e in entries]
    assert joined_entries(entries).split(ENTRY_SEPARATOR) == expected
    assert joined_entries([]) == b""


text = st.text(st.characters(codec="utf-8"), max_size=60)
ids = st.text(
    st.characters(codec="utf-8", exclude_characters=[chr(c) for c in range(0x20)] + ["\x7f"]),
    min_size=1,
    max_size=60,
)
"""Event ids the gate takes: no control character (``EVENT_ID_CONTROL_REASON``)."""
prices = st.one_of(
    st.floats(min_value=0, max_value=1_000_000, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1e-7, 0.1, 19.99, 1_000_000.0]),
    st.integers(min_value=0, max_value=1_000_000),
)
times = st.one_of(
    st.floats(min_value=1e-9, max_value=9_999_999_999.999, allow_nan=False),
    st.sampled_from([1_761_800_000.0, 1_761_800_000.321, 1e-7]),
)


@st.composite
def events(draw: st.DrawFn) -> ShopperEvent:
    kind = draw(st.sampled_from(["view", "click", "add_to_cart", "purchase", "search"]))
    record: dict[str, Any] = {
        "event_id": draw(ids),
        "shopper_id": draw(text.filter(bool)),
        "type": kind,
        "ts": draw(times),
        "query": draw(text) if kind != "search" else draw(text.filter(bool)),
        "quantity": draw(st.integers(min_value=1, max_value=1000)),
    }
    if kind != "search" or draw(st.booleans()):
        record["product"] = {
            "product_id": draw(text.filter(bool)),
            "title": draw(text.filter(bool)),
            "brand": draw(text),
            "category": draw(text),
            "snippet": draw(text),
            "price": draw(prices),
        }
    for name in draw(st.sets(st.sampled_from(["query", "quantity"]), max_size=2)):
        if name != "query" or kind != "search":
            record.pop(name)
    return parse_event(orjson.dumps(record))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events())
def test_fuzzed_events_are_stored_as_stored_event_writes_them(event: ShopperEvent) -> None:
    assert stored_json(event) == stored_event(event)
