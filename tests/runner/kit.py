"""Small builders the runner tests share."""

from __future__ import annotations

import uuid

from prompt_assembly.events import EventType, ProductSnapshot, ShopperEvent


def cart_add(shopper_id: str, ts: float, key: bytes | None = None) -> tuple[bytes, bytes, bool]:
    """A valid add-to-cart record (key, value, malformed=False), keyed by its shopper id unless ``key``
    says otherwise. A cart add prompts at once and leaves no pending trigger (outside the rate limit)."""
    return shopper_record(shopper_id, ts, "add_to_cart", key)


def view(shopper_id: str, ts: float) -> bytes:
    """A valid product view's value. Views inside the quiet period prompt nothing: they only move the
    pending browse pause, which the tests' timer scale never fires on the wall clock."""
    return shopper_record(shopper_id, ts, "view")[1]


def shopper_record(
    shopper_id: str, ts: float, kind: EventType, key: bytes | None = None
) -> tuple[bytes, bytes, bool]:
    event = ShopperEvent(
        event_id=uuid.uuid4().hex,
        shopper_id=shopper_id,
        type=kind,
        ts=ts,
        product=ProductSnapshot(product_id="p-1", title="Trail shoe", price=89.0),
    )
    return shopper_id.encode() if key is None else key, event.to_json(), False
