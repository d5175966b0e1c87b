"""``parse_events`` (one poll in one pass, what the runner calls) gives every record exactly what
``parse_event`` gives it: the same event (fields set included) or the same rejection reason, with the
event-time window applied to each record's own timestamp."""

from __future__ import annotations

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import (
    EventTimeWindow,
    MalformedEvent,
    ShopperEvent,
    parse_event,
    parse_events,
)
from tests.prompt_assembly.test_event_gate_tiers import EDGE_CASES, mutated_events

WINDOW = EventTimeWindow(max_ahead_s=300, max_behind_s=3600)


def _one_by_one(raws: list[bytes | None], times: list[float | None]) -> list[ShopperEvent | str]:
    out: list[ShopperEvent | str] = []
    for raw, record_time in zip(raws, times, strict=True):
        try:
            out.append(parse_event(raw, record_time, WINDOW))
        except MalformedEvent as exc:
            out.append(exc.reason)
    return out


def _assert_same(raws: list[bytes | None], times: list[float | None]) -> None:
    expected = _one_by_one(raws, times)
    got = parse_events(raws, times, WINDOW)
    assert len(got) == len(expected)
    for one, batch in zip(expected, got, strict=True):
        if isinstance(one, str):
            assert isinstance(batch, MalformedEvent)
            assert batch.reason == one
            continue
        assert isinstance(batch, ShopperEvent)
        assert batch == one
        assert batch.model_fields_set == one.model_fields_set
        if one.product is not None:
            assert batch.product is not None
            assert batch.product.model_fields_set == one.product.model_fields_set
        assert orjson.dumps(batch.model_dump()) == orjson.dumps(one.model_dump())


def test_edge_cases_and_a_null_value_match_one_by_one() -> None:
    raws: list[bytes | None] = [*EDGE_CASES, None, b"x" * 20_000]
    _assert_same(raws, [None] * len(raws))


def test_the_synthetic_stream_with_record_times_around_each_event() -> None:
    records = SyntheticStream(shoppers=40, seed=7, malformed_rate=0.05).take(1500)
    raws: list[bytes | None] = [value for _, value, _ in records]
    times: list[float | None] = []
    for i, raw in enumerate(raws):
        try:
            ts = float(orjson.loads(raw or b"null")["ts"])
        except Exception:
            ts = 1_761_800_000.0
        # in the window, far behind, far ahead, no timestamp, a non-positive one
        times.append([ts + 1, ts + 7200, ts - 900, None, 0.0][i % 5])
    _assert_same(raws, times)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated_events(), min_size=1, max_size=8), st.floats(-1e4, 1e4))
def test_fuzzed_polls_match_one_by_one(raws: list[bytes], offset: float) -> None:
    values: list[bytes | None] = list(raws)
    _assert_same(values, [1_761_800_000.5 + offset] * len(values))
