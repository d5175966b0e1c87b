"""Shopper events as they arrive on Kafka (topic ``shopper-events``, keyed by shopper id, JSON values).

``parse_event`` is the single gate between untrusted bytes and the pipeline: it either returns a valid
``ShopperEvent`` or raises ``MalformedEvent`` with a reason a person can act on. Callers send the
original bytes and that reason to the dead-letter topic; nothing invalid goes further.
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

SCHEMA_VERSION = 1
MAX_EVENT_BYTES = 16_384
"""Events larger than this are rejected before parsing: a product snapshot is a few hundred bytes."""

EventType = Literal["view", "click", "add_to_cart", "purchase", "search"]

ShortText = Annotated[str, Field(min_length=1, max_length=200)]
Snippet = Annotated[str, Field(max_length=600)]


class ProductSnapshot(BaseModel):
    """What the shopper saw of the product when the event happened (denormalised on purpose: the
    prompt must describe the product as shown, not as the catalog says today)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    product_id: ShortText
    title: ShortText
    brand: Annotated[str, Field(max_length=100)] = ""
    category: Annotated[str, Field(max_length=200)] = ""
    price: Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]
    snippet: Snippet = ""
    """Short description or review snippet: shopper- or seller-controlled text, always rendered inside
    a delimited data block, never as instructions."""


class ShopperEvent(BaseModel):
    """One shopper interaction. ``event_id`` is globally unique and is what deduplication keys on."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Annotated[int, Field(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION
    event_id: ShortText
    shopper_id: Annotated[str, Field(min_length=1, max_length=128)]
    type: EventType
    ts: Annotated[float, Field(gt=0, lt=10_000_000_000, allow_inf_nan=False)]
    """Event time, seconds since the epoch (when the shopper acted, not when we received it)."""
    product: ProductSnapshot | None = None
    query: Annotated[str, Field(max_length=300)] = ""
    quantity: Annotated[int, Field(ge=1, le=1000)] = 1

    @model_validator(mode="after")
    def _product_or_query(self) -> ShopperEvent:
        if self.type == "search":
            if not self.query:
                raise ValueError("a search event needs a non-empty 'query'")
        elif self.product is None:
            raise ValueError(f"a {self.type!r} event needs a 'product'")
        return self

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(exclude_defaults=False))


class MalformedEvent(ValueError):
    """Raised for input that cannot become a ``ShopperEvent``; ``reason`` is short and specific."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_EVENT = TypeAdapter(ShopperEvent)


def parse_event(raw: bytes | bytearray | memoryview | None) -> ShopperEvent:
    """Validate raw Kafka value bytes into an event, or raise ``MalformedEvent`` saying why."""
    if raw is None:
        raise MalformedEvent("empty message (null value)")
    if len(raw) > MAX_EVENT_BYTES:
        raise MalformedEvent(f"event is {len(raw)} bytes, over the {MAX_EVENT_BYTES}-byte limit")
    try:
        return _EVENT.validate_json(bytes(raw))
    except ValidationError as exc:
        raise MalformedEvent(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "json_invalid":
        return f"invalid JSON: {first['msg']}"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"
