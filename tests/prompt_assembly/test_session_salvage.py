"""``ShopperSession.salvage``: stored state this code cannot read (another version's, or corrupted) is
left out, never raised, so the engines' loads go on; what was left out is reported, and the session's
next save rewrites what is stored. ``restore`` stays strict."""

from __future__ import annotations

import orjson
import pytest

from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.session import ShopperSession, session_epoch

T0 = 1_764_000_000.0


def record(event_id: str, ts: float, kind: str = "view") -> bytes:
    product = {"product_id": "p-1", "title": "Witch Hat", "price": 9.5}
    return orjson.dumps(
        {"event_id": event_id, "shopper_id": "s-1", "type": kind, "ts": ts, "product": product}
    )


def stored_session(events: int) -> tuple[dict[str, object], list[bytes]]:
    processor = SessionProcessor(SessionConfig())
    session = processor.new_session("s-1")
    for i in range(events):
        processor.apply(session, parse_event(record(f"e-{i}", T0 + i)))
    return session.header(), [entry.to_json() for entry in session.entries]


def test_a_readable_session_is_restored_as_restore_does_and_reports_nothing() -> None:
    header, entries = stored_session(4)
    session, damage = ShopperSession.salvage("s-1", orjson.dumps(header), entries)
    assert damage is None and not session.dirty
    strict = ShopperSession.restore(header, entries)
    assert session.header() == strict.header() and session.events == strict.events


def test_an_unreadable_entry_is_left_out_and_the_log_is_rewritten_without_it() -> None:
    header, entries = stored_session(4)
    entries[2] = b'{"g":0,"n":2,"v":{"event_id":7}}'  # an event this schema refuses
    with pytest.raises(ValueError):
        ShopperSession.restore(header, entries)
    session, damage = ShopperSession.salvage("s-1", header, entries)
    assert damage is not None and damage.entries_dropped == 1 and not damage.header_lost
    assert [event.event_id for event in session.events] == ["e-0", "e-1", "e-3"]
    assert session.seq == header["seq"] and session.epoch == header["epoch"]
    changes = session.take_changes()
    assert changes.rewrite is not None and [entry.event.event_id for entry in changes.rewrite] == [
        "e-0",
        "e-1",
        "e-3",
    ]


@pytest.mark.parametrize(
    "header",
    [
        b'{"shopper_id": "s-1", "version": 9}',  # another version's header: no "seq"
        # a field of another shape
        b'{"shopper_id": "s-1", "seq": 1, "arrivals": 4, "last_prompt_ts": null, "pending": 5}',
        b"[1, 2]",
        b"{not json",
    ],
)
def test_an_unreadable_header_starts_the_shopper_over_as_a_new_session(header: bytes) -> None:
    _, entries = stored_session(3)
    session, damage = ShopperSession.salvage("s-1", header, entries)
    assert damage is not None and damage.header_lost and damage.entries_dropped == 3
    assert session.shopper_id == "s-1" and session.entries == [] and session.epoch == 0
    # Its next event starts a new epoch, and its save replaces the stored log with what it holds now.
    processor = SessionProcessor(SessionConfig())
    processor.apply(session, parse_event(record("e-9", T0 + 60)))
    assert session.epoch == session_epoch(T0 + 60)
    changes = session.take_changes()
    assert changes.rewrite is not None and [entry.event.event_id for entry in changes.rewrite] == ["e-9"]


def test_a_flink_state_value_that_does_not_decode_starts_the_shopper_over() -> None:
    header, entries = stored_session(2)
    whole = ShopperSession.restore(header, entries).to_json()
    assert ShopperSession.salvage_json("s-1", whole)[1] is None
    session, damage = ShopperSession.salvage_json("s-1", whole[:-9])  # cut short
    assert damage is not None and damage.header_lost and session.entries == []
    assert "DecodeError" in damage.why
