"""Shopper events as they arrive on Kafka (topic ``shopper-events``, keyed by shopper id, JSON values).

``parse_event`` is the single gate between untrusted bytes and the pipeline: it either returns a valid
``ShopperEvent`` or raises ``MalformedEvent`` with a reason a person can act on. Callers send the
original bytes and that reason to the dead-letter topic; nothing invalid goes further.

The pydantic models below are the schema. The gate has two tiers, so that the common case is cheap
without a second source of truth for what is valid or for why something is not:
- a fast tier (msgspec, a mirror of the schema with the same constraints) that only ever *accepts*: an
  event it decodes and that passes the product-or-query rule is built into the pydantic models without
  validating again;
- anything the fast tier does not accept, for whatever reason (a lax coercion pydantic allows, such as
  ``"quantity": 1.0``; a duplicate key; malformed input), goes to the pydantic validator, which alone
  decides and alone words every rejection.
So the outcome (the event, or the rejection and its reason) is pydantic's for every input;
``tests/prompt_assembly/test_event_gate_tiers.py`` checks that on fuzzed input, field by field.

Event time is checked against the Kafka record's timestamp when the engine passes it
(``EventTimeWindow``): one event stamped a day ahead by a device clock would otherwise hold every later
trigger of its shopper a day out, and one stamped 2001 would land in a 2001 partition. Such events are
refused with a reason starting ``EVENT_TIME_REASON`` (dead-lettered and counted like any other).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from prompt_assembly.errors import ShopperError

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


class EventTimeWindow(BaseModel):
    """Which event times the gate accepts, relative to the Kafka record's timestamp (the producer's
    send time, or the broker's append time on a ``LogAppendTime`` topic), so a replay of old records
    is judged exactly as the live run was. Records without a timestamp are not checked."""

    model_config = ConfigDict(frozen=True)

    max_ahead_s: float = Field(
        300.0,
        ge=0,
        description="an event may be stamped at most this far after its record (device clock skew); "
        "further ahead it would hold its shopper's triggers back until that time",
    )
    max_behind_s: float | None = Field(
        None,
        gt=0,
        description="an event may be stamped at most this far before its record; None: no relative "
        "bound (archives and synthetic streams replay old event times on purpose)",
    )
    not_before_ts: float = Field(
        1_577_836_800.0,
        ge=0,
        description="no event is older than this (2020-01-01 UTC): an earlier stamp is a producer's "
        "default or a unit mistake, not a shopper's action",
    )

    def violation(self, ts: float, record_time: float) -> str | None:
        """The rejection reason for an event stamped ``ts`` in a record stamped ``record_time``
        (seconds), or None when the event time is accepted."""
        if ts - record_time > self.max_ahead_s:
            return (
                f"{EVENT_TIME_REASON} {ts:.3f} is {ts - record_time:.0f} s after its record's timestamp "
                f"{record_time:.3f}, over the {self.max_ahead_s:g} s allowed"
            )
        if ts < self.not_before_ts:
            return f"{EVENT_TIME_REASON} {ts:.3f} is before {self.not_before_ts:.0f}, the earliest accepted"
        if self.max_behind_s is not None and record_time - ts > self.max_behind_s:
            return (
                f"{EVENT_TIME_REASON} {ts:.3f} is {record_time - ts:.0f} s before its record's timestamp "
                f"{record_time:.3f}, over the {self.max_behind_s:g} s allowed"
            )
        return None


EVENT_TIME_REASON = "ts: event time"
"""How every event-time rejection reason starts (engines count them apart from schema errors)."""

DEFAULT_EVENT_TIME_WINDOW = EventTimeWindow()

EVENT_ID_CONTROL_REASON = "event_id: control characters (U+0000-U+001F, U+007F) are not allowed"
"""Why an id holding one is refused. JSON writes such a character as six bytes (``\\u0001``), and the
ids travel in every result and prompt record (``new_event_ids``, ``trimmed_event_ids``: up to 912 of
200 characters): ids of control characters made a record of over 1 MB, which Kafka's default record
limit refuses, so the runner's results sink failed at every retry and restart, and the Flink job's
prompts sink with it. Any other character is at most four bytes, under 750 KB for the largest record."""
_ID_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _control_in_id(event_id: str) -> bool:
    """Whether ``event_id`` holds a control character: ``isprintable`` (in C) answers for nearly every id."""
    return not event_id.isprintable() and _ID_CONTROL.search(event_id) is not None


JSON_SCHEMA_PATH = "docs/event.schema.json"
"""Where the schema below is committed for producers (``tests/prompt_assembly/test_event_schema_file.py``
checks that it is the generated one)."""


def event_json_schema() -> dict[str, Any]:
    """The event schema as a JSON Schema (draft 2020-12), generated from ``ShopperEvent`` so that it
    cannot drift, plus what pydantic cannot write into it: the product-or-query rule (as ``if/then``),
    the gate's id rule (``EVENT_ID_CONTROL_REASON``, as a ``pattern``) and, in the description, the byte
    limit and the event-time window."""
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"shopper-event/v{SCHEMA_VERSION}",
        **_EVENT.json_schema(),
    }
    schema["description"] = (
        f"{schema['description']} The Kafka value of one event: UTF-8 JSON of at most {MAX_EVENT_BYTES} "
        "bytes, keyed by shopper_id. Fields not named here are ignored and never stored. 'ts' must also "
        "lie in the event-time window around the record's Kafka timestamp (docs/contracts.md)."
    )
    schema["properties"]["event_id"]["pattern"] = r"^[^\u0000-\u001f\u007f]*$"  # EVENT_ID_CONTROL_REASON
    schema["allOf"] = [
        {
            "if": {"properties": {"type": {"const": "search"}}, "required": ["type"]},
            "then": {"required": ["query"], "properties": {"query": {"minLength": 1}}},
            "else": {"required": ["product"], "properties": {"product": {"$ref": "#/$defs/ProductSnapshot"}}},
        }
    ]
    return schema


def event_json_schema_text() -> str:
    """``event_json_schema`` as the committed file holds it."""
    return orjson.dumps(event_json_schema(), option=orjson.OPT_INDENT_2).decode() + "\n"


class MalformedEvent(ShopperError, ValueError):
    """Raised for input that cannot become a ``ShopperEvent``; ``reason`` is short and specific."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_EVENT = TypeAdapter(ShopperEvent)


def parse_event(
    raw: bytes | bytearray | memoryview | None,
    record_time: float | None = None,
    window: EventTimeWindow = DEFAULT_EVENT_TIME_WINDOW,
) -> ShopperEvent:
    """Validate raw Kafka value bytes into an event, or raise ``MalformedEvent`` saying why.
    ``record_time``: the record's Kafka timestamp in seconds (None, or not positive: none known); the
    event's time must then lie in ``window`` around it."""
    event = _parse(raw)
    if _control_in_id(event.event_id):
        raise MalformedEvent(EVENT_ID_CONTROL_REASON)
    if record_time is not None and record_time > 0:
        problem = window.violation(event.ts, record_time)
        if problem is not None:
            raise MalformedEvent(problem)
    return event


def parse_events(
    raws: Sequence[bytes | None],
    record_times: Sequence[float | None],
    window: EventTimeWindow = DEFAULT_EVENT_TIME_WINDOW,
) -> list[ShopperEvent | MalformedEvent]:
    """``parse_event`` over one poll of records, in one pass: for each record, its event or the
    ``MalformedEvent`` ``parse_event`` would raise (returned, not raised: a rejection is a value here,
    and raising one per bad record costs more than deciding it). The outcome and the reason of every
    record are exactly ``parse_event``'s (``tests/prompt_assembly/test_event_batch.py``)."""
    decode = _decode_wire
    max_ahead, not_before, max_behind = window.max_ahead_s, window.not_before_ts, window.max_behind_s
    out: list[ShopperEvent | MalformedEvent] = []
    append = out.append
    for raw, record_time in zip(raws, record_times, strict=True):
        event: ShopperEvent | None = None
        if raw is not None and len(raw) <= MAX_EVENT_BYTES and mirror_may_decide(raw):
            try:
                event = _from_wire(decode(raw))
            except Exception:
                event = None
        if event is None:
            try:
                event = _parse(raw)
            except MalformedEvent as exc:
                append(exc)
                continue
        if _control_in_id(event.event_id):
            append(MalformedEvent(EVENT_ID_CONTROL_REASON))
            continue
        if record_time is not None and record_time > 0:
            ts = event.ts
            if (
                ts - record_time > max_ahead
                or ts < not_before
                or (max_behind is not None and record_time - ts > max_behind)
            ):
                problem = window.violation(ts, record_time)
                if problem is not None:
                    append(MalformedEvent(problem))
                    continue
        append(event)
    return out


def parse_stored_event(raw: bytes) -> ShopperEvent:
    """An event as a session stored it, after the gate took it: the schema alone, without rules the
    gate gained since (``EVENT_ID_CONTROL_REASON``), so a session stored before a rule stays readable."""
    return _parse(raw)


def record_time_s(timestamp: tuple[int, int]) -> float | None:
    """A confluent-kafka ``Message.timestamp()`` (type, ms) in seconds; None when the record has none
    (type 0, ``TIMESTAMP_NOT_AVAILABLE``)."""
    kind, ms = timestamp
    return ms / 1000.0 if kind != 0 and ms > 0 else None


def _parse(raw: bytes | bytearray | memoryview | None) -> ShopperEvent:
    if raw is None:
        raise MalformedEvent("empty message (null value)")
    if len(raw) > MAX_EVENT_BYTES:
        raise MalformedEvent(f"event is {len(raw)} bytes, over the {MAX_EVENT_BYTES}-byte limit")
    event = _fast_tier(raw)
    if event is not None:
        return event
    try:
        event = _EVENT.validate_json(bytes(raw))
    except ValidationError as exc:
        raise MalformedEvent(describe_validation_error(exc)) from None
    _reject_what_json_value_refuses(raw)
    return event


MAX_NUMBER_CHARS = 1000
"""The longest number literal an event may hold, in any field: Flink's JSON functions (Jackson's
``StreamReadConstraints``, 1,000 characters) refuse a longer one, so the Flink job could not read the
event's key (``JSON_VALUE``), and the same bytes were a dead letter there and an event here."""
_LONG_NUMBER = re.compile(rb"[-+.eE0-9]{%d}" % (MAX_NUMBER_CHARS + 1))
"""A run of number characters past the limit: a number literal that may be too long (or a string of
such characters, which ``_reject_what_json_value_refuses`` tells apart)."""


def _reject_what_json_value_refuses(raw: bytes | bytearray | memoryview) -> None:
    """Two things pydantic's parser takes in a field the schema ignores and Flink's ``JSON_VALUE``
    (Jackson), which reads the Flink job's key, refuses, so the same bytes were a dead letter there and
    an event here: ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON (RFC 8259) though
    Python's ``json.dumps`` writes them, and a number literal over ``MAX_NUMBER_CHARS``. Checked only
    where pydantic accepted (the fast tier's msgspec refuses the first; ``mirror_may_decide`` sends the
    second to pydantic), with one second parse, only where either may be there at all."""
    data = bytes(raw)
    constants = b"NaN" in data or b"Infinity" in data
    if not constants and (len(data) <= MAX_NUMBER_CHARS or _LONG_NUMBER.search(data) is None):
        return  # the common case: no second parse
    found: list[str] = []
    longest = [0]

    def constant(literal: str) -> float:
        found.append(literal)
        return 0.0

    def number(literal: str) -> float:
        longest[0] = max(longest[0], len(literal))
        return 0.0

    try:
        json.loads(data, parse_constant=constant, parse_int=number, parse_float=number)
    except ValueError:  # pydantic accepted it: not expected, and not this check's to judge
        return
    if found:
        raise MalformedEvent(f"invalid JSON: {found[0]} is not a JSON number (RFC 8259)")
    if longest[0] > MAX_NUMBER_CHARS:
        raise MalformedEvent(
            f"invalid JSON: a number of {longest[0]} characters, over the {MAX_NUMBER_CHARS} "
            "that JSON readers such as Flink's accept"
        )


# ---- the fast tier: a msgspec mirror of the schema above (keep the two in step) ------------------
_Unset = msgspec.UnsetType
_UNSET = msgspec.UNSET
_M = TypeVar("_M", bound=BaseModel)
_V = TypeVar("_V")
_D = TypeVar("_D")


_WireShortText = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_WireShopperId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class _WireProduct(msgspec.Struct, frozen=True, gc=False):
    product_id: _WireShortText
    title: _WireShortText
    price: Annotated[float, msgspec.Meta(ge=0, le=1_000_000)]
    brand: Annotated[str, msgspec.Meta(max_length=100)] | _Unset = _UNSET
    category: Annotated[str, msgspec.Meta(max_length=200)] | _Unset = _UNSET
    snippet: Annotated[str, msgspec.Meta(max_length=600)] | _Unset = _UNSET


class _WireEvent(msgspec.Struct, frozen=True, gc=False):
    event_id: _WireShortText
    shopper_id: _WireShopperId
    type: EventType
    ts: Annotated[float, msgspec.Meta(gt=0, lt=10_000_000_000)]
    schema_version: Annotated[int, msgspec.Meta(ge=1, le=SCHEMA_VERSION)] | _Unset = _UNSET
    product: _WireProduct | _Unset | None = _UNSET
    query: Annotated[str, msgspec.Meta(max_length=300)] | _Unset = _UNSET
    quantity: Annotated[int, msgspec.Meta(ge=1, le=1000)] | _Unset = _UNSET


_WIRE = msgspec.json.Decoder(_WireEvent)
_decode_wire = _WIRE.decode
_new = object.__new__
_set = object.__setattr__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__
"""``BaseModel``'s slot setters, called directly: ``object.__setattr__`` looks each one up again."""
_PRODUCT_REQUIRED = frozenset({"product_id", "title", "price"})
_EVENT_REQUIRED = frozenset({"event_id", "shopper_id", "type", "ts"})
_PRODUCT_ALL: set[str] = set(ProductSnapshot.model_fields)
_EVENT_ALL: set[str] = set(ShopperEvent.model_fields)
"""The fields set of an event (a product) that names every field, as this pipeline's producers write
them: one set shared by every such model instead of one per model (two fewer objects per event for
the collector to track). Sharing is safe because the models are frozen: pydantic never adds to a
frozen model's fields set (``model_copy(update=...)`` adds to the copy's own copy). Nothing may add
to ``model_fields_set`` of a parsed event."""


def _fast_tier(raw: bytes | bytearray | memoryview) -> ShopperEvent | None:
    """The event, when the msgspec mirror accepts ``raw`` and the product-or-query rule holds; None
    (let pydantic decide) otherwise. Never raises: msgspec's errors, and its RecursionError on deep
    nesting, all mean "not here"."""
    if not mirror_may_decide(raw):
        return None
    try:
        wire = _decode_wire(raw)
    except Exception:
        return None
    return _from_wire(wire)


MIRROR_MAX_BRACKETS = 200
"""More ``[`` and ``{`` than this (pydantic refuses nesting past 200) and pydantic decides; an event this
pipeline's producers write has a handful. Nesting that deep takes more than twice as many bytes, so
shorter events are not counted at all."""


def mirror_may_decide(raw: bytes | bytearray | memoryview) -> bool:
    """Whether the msgspec mirror may decide ``raw``. It skips a field it does not know without
    checking it, where pydantic checks every byte: invalid UTF-8 there, or a number past 4,300 digits,
    or nesting past pydantic's limit, is accepted by the one and refused by the other (and a number past
    ``MAX_NUMBER_CHARS``, which ``_reject_what_json_value_refuses`` refuses after pydantic). Nesting is also
    where msgspec's own limit depends on how deep the caller's stack is, so the same bytes were an event
    for ``parse_events`` and a rejection for ``parse_event``. Such bytes go to pydantic. The common
    case (a few hundred ASCII bytes) costs a length and an ASCII check, in C."""
    data = raw if isinstance(raw, bytes) else bytes(raw)
    size = len(data)
    if size > 2 * MIRROR_MAX_BRACKETS and data.count(b"{") + data.count(b"[") > MIRROR_MAX_BRACKETS:
        return False
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return size <= MAX_NUMBER_CHARS or _LONG_NUMBER.search(data) is None


def _from_wire(wire: _WireEvent) -> ShopperEvent | None:
    """The event ``wire`` describes, with pydantic's defaults for the fields it leaves out and the
    fields set pydantic would record; None where the product-or-query rule fails (pydantic words it)."""
    product, query, schema_version, quantity = wire.product, wire.query, wire.schema_version, wire.quantity
    fields_set = _EVENT_ALL
    if product is _UNSET or query is _UNSET or schema_version is _UNSET or quantity is _UNSET:
        fields_set = set(_EVENT_REQUIRED)
        product = _given(product, None, "product", fields_set)
        query = _given(query, "", "query", fields_set)
        schema_version = _given(schema_version, SCHEMA_VERSION, "schema_version", fields_set)
        quantity = _given(quantity, 1, "quantity", fields_set)
    if (not query) if wire.type == "search" else (product is None):
        return None
    values = {
        "schema_version": schema_version,
        "event_id": wire.event_id,
        "shopper_id": wire.shopper_id,
        "type": wire.type,
        "ts": wire.ts,
        "product": None if product is None else _product(product),
        "query": query,
        "quantity": quantity,
    }
    return _built(ShopperEvent, values, fields_set)


def _product(wire: _WireProduct) -> ProductSnapshot:
    """``_from_wire`` for the product: defaults for the optional fields left out, and its fields set."""
    brand, category, snippet = wire.brand, wire.category, wire.snippet
    fields_set = _PRODUCT_ALL
    if brand is _UNSET or category is _UNSET or snippet is _UNSET:
        fields_set = set(_PRODUCT_REQUIRED)
        brand = _given(brand, "", "brand", fields_set)
        category = _given(category, "", "category", fields_set)
        snippet = _given(snippet, "", "snippet", fields_set)
    values = {
        "product_id": wire.product_id,
        "title": wire.title,
        "brand": brand,
        "category": category,
        "price": wire.price,
        "snippet": snippet,
    }
    return _built(ProductSnapshot, values, fields_set)


def _given(value: _V | _Unset, default: _D, name: str, fields_set: set[str]) -> _V | _D:
    """``value`` when the message gave it (recorded in ``fields_set``, as pydantic records it), else
    the field's ``default``."""
    if value is _UNSET:
        return default
    fields_set.add(name)
    return value


def _built(cls: type[_M], values: dict[str, Any], fields_set: set[str]) -> _M:
    """An instance of ``cls`` holding already-validated ``values``: what ``model_construct`` does for
    a model without extra or private attributes, in a fraction of its time (the whole point of the
    fast tier). ``tests/prompt_assembly/test_event_gate_tiers.py`` compares the result with pydantic's
    own, internals included, so a pydantic upgrade that changes them fails there."""
    model = _new(cls)
    _set(model, "__dict__", values)
    _set_fields_set(model, fields_set)
    _set_extra(model, None)
    _set_private(model, None)
    return model


def describe_validation_error(exc: ValidationError) -> str:
    """A dead letter's reason for a record its model refused: the first error, where it is, and how
    many more (the event gate's, and the prompts runner's for a record that is not a prompt)."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "json_invalid":
        return f"invalid JSON: {first['msg']}"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"
