"""What a session keeps of an event is only its schema fields: whatever else a producer adds
(``session_id``, ``device``, ``utm_source``, a ``gtin``: possibly personal data) is never stored, not
in the runner's Redis log (checked in the real Redis) nor in the Flink state value, and a log written
before this is stored again without it."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.session import SessionEntry, ShopperSession, stored_event
from runner.session_store import RedisSessionStore, SessionDelta

IGNORED = {
    "session_id": "web-7f3a",
    "utm_source": "newsletter",
    "device": {"os": "iOS 17", "ip": "203.0.113.9"},
    "email": "jane@example.com",
}
"""Fields the schema ignores, at the top level and in the product."""


def record(event_id: str, ts: float, **extra: Any) -> bytes:
    product = {"product_id": "p-1", "title": "Witch Hat", "brand": "Spooky", "price": 9.5, "gtin": "0123"}
    event = {"event_id": event_id, "shopper_id": "s-1", "type": "view", "ts": ts, "product": product}
    return orjson.dumps({**event, **extra})


def assert_keeps_nothing_ignored(stored: bytes) -> None:
    for name in [*IGNORED, "gtin"]:
        assert name.encode() not in stored, f"{name} was stored"
    for value in ("web-7f3a", "jane@example.com", "203.0.113.9"):
        assert value.encode() not in stored


def test_a_session_stores_only_the_schema_fields_of_its_events() -> None:
    processor = SessionProcessor(SessionConfig())
    session = processor.new_session("s-1")
    raw = record("e-1", 1_764_000_000.0, **IGNORED)
    event = parse_event(raw)
    processor.apply(session, event, raw)
    assert_keeps_nothing_ignored(session.to_json())
    # The stored form is the same whatever the record carried besides the schema.
    assert stored_event(event) == stored_event(parse_event(record("e-1", 1_764_000_000.0)))
    restored = ShopperSession.from_json(session.to_json())
    assert restored.events == session.events and restored.header() == session.header()


def test_a_log_stored_with_the_producers_bytes_is_read_and_stored_again_without_them() -> None:
    raw = record("e-1", 1_764_000_000.0, **IGNORED)
    legacy = b'{"g":0,"n":0,"e":%b}' % raw
    header = ShopperSession("s-1").header() | {"arrivals": 1}
    session = ShopperSession.restore(header, [legacy])
    assert session.events == [parse_event(raw)]
    changes = session.take_changes()
    assert changes.rewrite is not None, "the whole log is written again"
    for entry in changes.rewrite:
        assert_keeps_nothing_ignored(entry.to_json())
    assert SessionEntry.from_json(changes.rewrite[0].to_json()).event == parse_event(raw)


async def test_the_runners_redis_log_holds_no_ignored_field(redis_client: Any) -> None:
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    processor = SessionProcessor(SessionConfig())
    session = processor.new_session("s-1")
    try:
        for i in range(3):
            raw = record(f"e-{i}", 1_764_000_000.0 + i, **IGNORED)
            processor.apply(session, parse_event(raw), raw)
        await store.save(
            [SessionDelta("s-1", 0, session.take_changes(), None)], {0: await store.take_ownership(0)}
        )
        stored: list[bytes] = await redis_client.lrange(store.keys.session_log("s-1"), 0, -1)
        assert len(stored) == len(session.entries)
        for entry in stored:
            assert_keeps_nothing_ignored(entry)
        loaded = (await store.load_many(["s-1"]))["s-1"]
        assert loaded.events == session.events
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)
