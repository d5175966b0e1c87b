"""An event id holding a control character is refused at the gate, by both of its tiers and in a whole
poll, with one reason. JSON writes such a character as six bytes, and the ids travel in every result and
prompt record: ids of them made records over Kafka's default 1 MB limit, which the runner's results sink
and the Flink job's prompts sink then failed to write at every retry and restart. With the rule the
largest records stay under that limit, and a session stored before the rule is still read."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from prompt_assembly.events import EVENT_ID_CONTROL_REASON, MalformedEvent, parse_event, parse_events
from prompt_assembly.processor import SessionConfig
from prompt_assembly.records import PromptRequest, ShopperInsight, Usage
from prompt_assembly.session import SessionEntry
from prompt_assembly.understanding import ShopperUnderstanding

KAFKA_DEFAULT_RECORD_BYTES = 1_000_000
"""librdkafka's ``message.max.bytes`` default; Kafka's brokers take about 1 MB too."""


def event(event_id: str, **extra: Any) -> bytes:
    product = {"product_id": "p-1", "title": "Witch Hat", "price": 9.5}
    return orjson.dumps(
        {"event_id": event_id, "shopper_id": "s-1", "type": "view", "ts": 1_764_000_000.5, "product": product}
        | extra
    )


@pytest.mark.parametrize("char", ["\x00", "\x01", "\n", "\x1f", "\x7f"], ids=repr)
@pytest.mark.parametrize("lax", [False, True], ids=["fast_tier", "pydantic_tier"])
def test_an_event_id_with_a_control_character_is_refused_with_one_reason(char: str, lax: bool) -> None:
    # "quantity": 1.0 is a coercion only pydantic makes: that event goes to the second tier.
    raw = event(f"e-{char}-1", **({"quantity": 1.0} if lax else {}))
    with pytest.raises(MalformedEvent) as refused:
        parse_event(raw)
    assert refused.value.reason == EVENT_ID_CONTROL_REASON
    (outcome,) = parse_events([raw], [None])
    assert isinstance(outcome, MalformedEvent) and outcome.reason == EVENT_ID_CONTROL_REASON


@pytest.mark.parametrize("char", ["é", "\U0001f600", "\u00a0", "\u2028", '"', "\\", " "], ids=repr)
def test_any_other_character_in_an_id_is_taken(char: str) -> None:
    raw = event(f"e-{char}-1")
    assert parse_event(raw).event_id == f"e-{char}-1"
    (outcome,) = parse_events([raw], [None])
    assert not isinstance(outcome, MalformedEvent) and outcome.event_id == f"e-{char}-1"


def test_a_session_entry_stored_before_the_rule_is_still_read() -> None:
    stored = b'{"g":0,"n":1,"v":%b}' % event("e-\x01-1")
    assert SessionEntry.from_json(stored).event.event_id == "e-\x01-1"


def records_with_ids(event_id: str) -> list[bytes]:
    """A result and a prompt record as large as their ids can make them: a full log's new ids and the
    trimmed ids a session remembers (``SessionConfig``'s defaults)."""
    config = SessionConfig()
    new, trimmed = [event_id] * config.max_events, [event_id] * config.remember_trimmed_ids
    about: dict[str, Any] = {
        "request_id": "s-1:1:2", "shopper_id": "s-1", "session_epoch": 1, "seq": 2, "reason": "purchase",
        "event_count": config.max_events, "new_event_ids": new, "trimmed_event_ids": trimmed,
        "trimmed_events": len(trimmed), "last_event_ts": 1_764_000_000.5,
    }  # fmt: skip
    insight = ShopperInsight(
        **about,
        understanding=ShopperUnderstanding(
            interests=["hats"], occasion=None, style="fun", price_sensitivity="low", summary="s" * 240
        ),
        text="s" * 240, model="m", replica="r0", usage=Usage(), ttft_ms=1, latency_ms=1, attempts=1,
        produced_at=time.time(),
    )  # fmt: skip
    prompt = PromptRequest(**about, messages=[], prompt_tokens=0, shared_prefix_tokens=0)
    return [insight.model_dump_json().encode(), prompt.model_dump_json().encode()]


def test_the_largest_records_stay_under_kafkas_default_record_limit() -> None:
    widest_allowed = "\U0001f600" * 200  # four bytes a character, the most JSON spends on one
    assert all(len(record) < 0.8 * KAFKA_DEFAULT_RECORD_BYTES for record in records_with_ids(widest_allowed))
    refused = "\x01" * 200  # six bytes a character
    assert all(len(record) > KAFKA_DEFAULT_RECORD_BYTES for record in records_with_ids(refused))
