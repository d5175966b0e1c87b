"""Event time outside the accepted window around the record's Kafka timestamp is refused at the gate,
with a reason the engines count apart, so one mis-stamped event cannot silence its shopper."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from prompt_assembly.events import (
    DEFAULT_EVENT_TIME_WINDOW,
    EVENT_TIME_REASON,
    EventTimeWindow,
    MalformedEvent,
    parse_event,
    record_time_s,
)
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import PromptRequest
from runner.dead_letters import reason_category

RECORD_TS = 1_764_000_000.0
"""When the records were produced (their Kafka timestamp)."""
DAY_S = 86_400.0
WINDOW = DEFAULT_EVENT_TIME_WINDOW


def raw_event(event_id: str, kind: str, ts: float, shopper: str = "s-1") -> bytes:
    product = {"product_id": "p-1", "title": "Witch Costume", "price": 19.99}
    return orjson.dumps(
        {"event_id": event_id, "shopper_id": shopper, "type": kind, "ts": ts, "product": product}
    )


def test_an_event_stamped_past_the_allowed_skew_is_refused_with_an_event_time_reason() -> None:
    ahead = raw_event("e-1", "view", RECORD_TS + WINDOW.max_ahead_s + 1)
    with pytest.raises(MalformedEvent) as refused:
        parse_event(ahead, RECORD_TS)
    assert refused.value.reason.startswith(EVENT_TIME_REASON)
    assert reason_category(refused.value.reason) == "event_time"
    # Within the skew it is accepted, and without a record timestamp nothing is checked.
    assert parse_event(raw_event("e-2", "view", RECORD_TS + WINDOW.max_ahead_s), RECORD_TS).ts > RECORD_TS
    assert parse_event(ahead, None).event_id == "e-1"
    assert parse_event(ahead, 0).event_id == "e-1"


@pytest.mark.parametrize(
    ("window", "ts"),
    [
        (WINDOW, WINDOW.not_before_ts - 1),  # a producer default or a unit mistake ("2001-09-09")
        (EventTimeWindow(max_behind_s=DAY_S), RECORD_TS - 2 * DAY_S),
    ],
)
def test_an_event_too_far_in_the_past_is_refused(window: EventTimeWindow, ts: float) -> None:
    with pytest.raises(MalformedEvent) as refused:
        parse_event(raw_event("e-1", "view", ts), RECORD_TS, window)
    assert reason_category(refused.value.reason) == "event_time"


def test_by_default_an_old_event_is_accepted_however_old() -> None:
    """Archives and synthetic streams replay old event times on purpose: the default window bounds only
    how far an event may be ahead of its record (and the 2020 floor), never how far behind."""
    assert WINDOW.max_behind_s is None
    for behind_s in (WINDOW.max_ahead_s + 1, 2 * DAY_S, 365 * DAY_S):
        assert parse_event(raw_event("e-old", "view", RECORD_TS - behind_s), RECORD_TS).event_id == "e-old"


def test_the_kafka_timestamp_tuple_becomes_seconds_or_none() -> None:
    assert record_time_s((1, int(RECORD_TS * 1000))) == RECORD_TS
    assert record_time_s((0, -1)) is None  # TIMESTAMP_NOT_AVAILABLE


def test_one_event_from_a_clock_a_day_ahead_no_longer_silences_its_shopper() -> None:
    """A future-stamped cart add, reproduced: browsing, one cart add stamped a day ahead, then purchases
    and cart adds over the next hour. Through the gate (with the record times) and the processor, every later
    immediate event still prompts; before the window, none did."""
    processor = SessionProcessor(SessionConfig())
    session = processor.new_session("s-1")
    interval = processor.config.triggers.min_prompt_interval_s
    records: list[tuple[bytes, float]] = []
    t = RECORD_TS
    for i in range(20):
        records.append((raw_event(f"v{i}", "view", t), t))
        t += 3
    records.append((raw_event("future", "add_to_cart", t + DAY_S), t))
    later: list[tuple[str, str]] = [(f"c{i}", "add_to_cart") for i in range(9)]
    later += [(f"p{i}", "purchase") for i in range(3)]
    for event_id, kind in later:
        t += 2 * interval  # each after the rate limit: each must prompt at once
        records.append((raw_event(event_id, kind, t), t))
    prompts: list[PromptRequest] = []
    refused: list[str] = []
    for raw, record_ts in records:
        try:
            event = parse_event(raw, record_ts, processor.config.event_time)
        except MalformedEvent as exc:
            refused.append(exc.reason)
            continue
        prompts += processor.apply(session, event).prompts
    assert len(refused) == 1 and reason_category(refused[0]) == "event_time"
    immediate = [p for p in prompts if p.reason != "browse_pause"]
    assert len(immediate) == len(later)
    assert session.last_event_ts <= t


def test_the_window_is_a_session_setting_read_from_json() -> None:
    settings: dict[str, Any] = {"event_time": {"max_ahead_s": 60, "max_behind_s": DAY_S}}
    config = SessionConfig.model_validate(settings)
    assert config.event_time == EventTimeWindow(max_ahead_s=60, max_behind_s=DAY_S)
