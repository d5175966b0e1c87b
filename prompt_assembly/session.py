"""Per-shopper session state: an append-only, deduplicated, bounded activity log.

Ordering guarantees (what keeps prompts prefix-stable):
- entries already sent in a prompt never move: a late event is placed among the *unprompted* entries
  only, in event-time order. Each entry records ``segment`` (the prompt number it first appears in) and
  an arrival number, and the log is always sorted by ``(segment, ts, arrival)``. That key is stored with
  the entry, so a session rebuilt from storage has exactly the same order.
- the log is trimmed only from its head and in large steps (see ``SessionConfig.trim_to_fraction``),
  so the prompt's prefix changes rarely.
Deduplication covers every event still in the log plus a bounded memory of trimmed ids.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from prompt_assembly.events import MalformedEvent, ShopperEvent, parse_stored_event
from prompt_assembly.records import TriggerReason


@dataclass(slots=True)
class SessionEntry:
    segment: int
    arrival: int
    event: ShopperEvent
    line: str | None = field(default=None, compare=False)
    """Rendered log line, cached by the prompt builder (a pure function of ``event``)."""
    tokens: int = field(default=0, compare=False)
    stored: bytes | None = field(default=None, compare=False, repr=False)
    """The event as it is stored (``stored_event``), cached: made once, written on every save."""
    legacy: bool = field(default=False, compare=False, repr=False)
    """Read from an entry that kept the producer's bytes (ignored fields included): store it again."""

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.segment, self.event.ts, self.arrival)

    def to_json(self) -> bytes:
        """The stored entry: its sort key and the event's schema fields only (``stored_event``)."""
        if self.stored is None:
            self.stored = stored_event(self.event)
        return b'{"g":%d,"n":%d,"v":%b}' % (self.segment, self.arrival, self.stored)

    @classmethod
    def from_json(cls, raw: bytes | str) -> SessionEntry:
        """An entry as ``to_json`` stored it. The event goes through the event schema again (the gate's
        fast tier, for what this pipeline wrote; ``parse_stored_event``: not the rules the gate gained
        after the entry was stored). An entry from before ``stored_event`` (key ``e``: the
        producer's bytes, ignored fields included) is read the same way and stored again without them."""
        stored = _STORED_ENTRY.decode(raw)
        if not isinstance(stored.v, msgspec.UnsetType):
            event_json = bytes(stored.v)
            return cls(stored.g, stored.n, parse_stored_event(event_json), stored=event_json)
        if isinstance(stored.e, msgspec.UnsetType):
            raise MalformedEvent("a stored session entry holds no event")
        return cls(stored.g, stored.n, parse_stored_event(bytes(stored.e)), legacy=True)


def stored_event(event: ShopperEvent) -> bytes:
    """The JSON a session keeps of an event: the fields prompts and deduplication use, with defaults
    left out, never a field the schema ignores (``session_id``, ``device``, ``utm_source``: whatever a
    producer adds is not kept for the state's lifetime). Each field is bounded by the schema, so an
    entry stays under about 1,800 characters, whatever the size of the record it came from."""
    data: dict[str, Any] = {
        "event_id": event.event_id,
        "shopper_id": event.shopper_id,
        "type": event.type,
        "ts": event.ts,
    }
    product = event.product
    if product is not None:
        snapshot: dict[str, Any] = {"product_id": product.product_id, "title": product.title}
        for name in ("brand", "category", "snippet"):
            if value := getattr(product, name):
                snapshot[name] = value
        snapshot["price"] = product.price
        data["product"] = snapshot
    if event.query:
        data["query"] = event.query
    if event.quantity != 1:
        data["quantity"] = event.quantity
    return orjson.dumps(data)


class _StoredEntry(msgspec.Struct, gc=False):
    g: int
    n: int
    v: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    """The event as ``stored_event`` wrote it."""
    e: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    """Before ``stored_event``: the producer's bytes."""


_STORED_ENTRY = msgspec.json.Decoder(_StoredEntry)


class _StoredSession(msgspec.Struct, gc=False):
    h: dict[str, Any]
    entries: list[msgspec.Raw]


_STORED_SESSION = msgspec.json.Decoder(_StoredSession)


def session_epoch(first_event_ts: float) -> int:
    """The epoch of a session started by an event at ``first_event_ts`` (seconds): its milliseconds."""
    return int(first_event_ts * 1000)


@dataclass(slots=True)
class PendingTrigger:
    reason: TriggerReason
    due_ts: float
    """Event time at which the prompt should fire if nothing else fires it first."""


@dataclass(slots=True)
class SessionChanges:
    """What changed since the last ``take_changes``: enough for a store to persist a delta."""

    appended: list[SessionEntry]
    rewrite: list[SessionEntry] | None
    """Set when the log was trimmed: the whole log, to store instead of appending."""
    header: dict[str, Any]


@dataclass(slots=True)
class ShopperSession:
    shopper_id: str
    entries: list[SessionEntry] = field(default_factory=list)
    seq: int = 0
    """Prompts emitted so far; also the segment of entries arriving now."""
    epoch: int = 0
    """Which session of the shopper this is: the event time, in milliseconds, of the event that started
    it (``session_epoch``), so a session started after the state was lost (a redeploy without a
    savepoint, a state TTL, an engine switch) outranks the one before it, and a replay from the same
    first event reproduces it. 0: a session stored before epochs existed."""
    arrivals: int = 0
    last_prompt_ts: float | None = None
    pending: PendingTrigger | None = None
    trimmed_ids: deque[str] = field(default_factory=deque)
    last_log_tokens: int = 0
    """Tokens of the last prompt up to the end of its activity log (its reusable prefix)."""
    trimmed_since_prompt: bool = False
    unprompted_trimmed_ids: list[str] = field(default_factory=list)
    """Events trimmed from the log before any prompt took them, since the last prompt (the newest
    ``remember_ids`` of them): the next prompt names them, so every event is accounted for."""
    unprompted_trimmed: int = 0
    """How many events were trimmed before any prompt took them since the last prompt (all of them,
    where ``unprompted_trimmed_ids`` keeps a bounded number)."""
    newest_ts: float = 0.0
    _ids: set[str] = field(default_factory=set)
    _appended: list[SessionEntry] = field(default_factory=list)
    _rewrite: bool = False

    # ---- reading -------------------------------------------------------------------------------
    @property
    def events(self) -> list[ShopperEvent]:
        return [e.event for e in self.entries]

    @property
    def last_event_ts(self) -> float:
        """Event time of the newest event in the log."""
        return self.newest_ts

    def has_seen(self, event_id: str) -> bool:
        return event_id in self._ids

    def unprompted(self) -> list[SessionEntry]:
        return [e for e in self.entries if e.segment >= self.seq]

    # ---- changing ------------------------------------------------------------------------------
    def add(self, event: ShopperEvent, raw: bytes | None = None) -> bool:
        """Insert ``event`` in order; returns False (and changes nothing) for a duplicate. ``raw`` (the
        record the event was parsed from) is not kept: only the event's schema fields are stored."""
        del raw
        if event.event_id in self._ids:
            return False
        entry = SessionEntry(self.seq, self.arrivals, event)
        self.arrivals += 1
        entries = self.entries
        # In order unless it sorts before the last entry: the segment never decreases and the arrival
        # always grows, so only an older event time in the same segment goes elsewhere.
        if not entries or entry.segment > entries[-1].segment or event.ts >= entries[-1].event.ts:
            entries.append(entry)  # the common case: events arrive in order
        else:
            at = bisect.bisect_right(entries, entry.sort_key, key=lambda e: e.sort_key)
            entries.insert(at, entry)
        if event.ts > self.newest_ts:
            self.newest_ts = event.ts
        self._ids.add(event.event_id)
        self._appended.append(entry)
        return True

    def trim_head(self, count: int, remember_ids: int) -> None:
        """Drop the ``count`` oldest entries, remembering their ids for deduplication, and those no
        prompt has taken for the next prompt to name (``unprompted_trimmed_ids``)."""
        if count <= 0:
            return
        dropped, self.entries = self.entries[:count], self.entries[count:]
        for entry in dropped:
            self._ids.discard(entry.event.event_id)
            self.trimmed_ids.append(entry.event.event_id)
            if entry.segment >= self.seq:  # no prompt has taken it
                self.unprompted_trimmed += 1
                self.unprompted_trimmed_ids.append(entry.event.event_id)
        while len(self.trimmed_ids) > remember_ids:  # forgotten here, as a restored session forgets it
            self._ids.discard(self.trimmed_ids.popleft())
        del self.unprompted_trimmed_ids[: max(0, len(self.unprompted_trimmed_ids) - remember_ids)]
        self._ids.update(self.trimmed_ids)
        # ``newest_ts`` stays the newest event seen: the log is ordered by segment first, so late
        # events can push the newest one out, and a quiet period counted from an older time ended early.
        self.trimmed_since_prompt = True
        self._rewrite = True

    def mark_prompted(self, last_log_tokens: int, due_ts: float) -> None:
        """A prompt due at ``due_ts`` (event time) was emitted. The rate limit counts from then: counted
        from the newest event it held instead, a prompt the limit (or a pause) had held back barely
        delayed the next one, and a shopper adding to cart every 5.5 s was prompted every 5.5 s."""
        self.seq += 1
        self.last_prompt_ts = max(self.last_event_ts, due_ts)
        self.pending = None
        self.last_log_tokens = last_log_tokens
        self.trimmed_since_prompt = False
        self.unprompted_trimmed_ids = []
        self.unprompted_trimmed = 0

    # ---- persistence ---------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {
            "shopper_id": self.shopper_id,
            "seq": self.seq,
            "epoch": self.epoch,
            "arrivals": self.arrivals,
            "last_prompt_ts": self.last_prompt_ts,
            "pending": None if self.pending is None else [self.pending.reason, self.pending.due_ts],
            "trimmed_ids": list(self.trimmed_ids),
            "last_log_tokens": self.last_log_tokens,
            "trimmed_since_prompt": self.trimmed_since_prompt,
            "unprompted_trimmed_ids": list(self.unprompted_trimmed_ids),  # a copy: saved after later trims
            "unprompted_trimmed": self.unprompted_trimmed,
            "newest_ts": self.newest_ts,
        }

    @property
    def dirty(self) -> bool:
        return bool(self._appended) or self._rewrite

    def take_changes(self) -> SessionChanges:
        changes = SessionChanges(
            list(self._appended), list(self.entries) if self._rewrite else None, self.header()
        )
        self._appended.clear()
        self._rewrite = False
        return changes

    def to_json(self) -> bytes:
        """The whole session, for engines that keep it as one state value (Flink ValueState): the
        header and each entry exactly as ``SessionEntry.to_json`` gives it, so an entry is the same
        bytes here as in the runner's Redis log (``runner.session_store``)."""
        entries = b",".join(entry.to_json() for entry in self.entries)
        return b'{"h":%b,"entries":[%b]}' % (orjson.dumps(self.header()), entries)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ShopperSession:
        stored = _STORED_SESSION.decode(raw)
        return cls.restore(stored.h, [bytes(entry) for entry in stored.entries])

    @classmethod
    def salvage_json(cls, shopper_id: str, raw: bytes | str) -> tuple[ShopperSession, RestoreDamage | None]:
        """``from_json`` that never raises for what it cannot read (``salvage``)."""
        try:
            stored = _STORED_SESSION.decode(raw)
        except ValueError as error:
            return cls._started_over(shopper_id, 0, error)
        return cls.salvage(shopper_id, stored.h, [bytes(entry) for entry in stored.entries])

    @classmethod
    def salvage(
        cls, shopper_id: str, header: dict[str, Any] | bytes, entries: list[bytes]
    ) -> tuple[ShopperSession, RestoreDamage | None]:
        """``restore`` for the engines: stored state this code cannot read (written by a version it
        does not know, after a rollback, or corrupted) must not stop the stream, and raising here made
        every retry and restart fail at the same shopper. An unreadable entry is left out; an unreadable
        header starts the shopper over, as a session whose state was lost (a new epoch at its next
        event). Either way the session's next save rewrites what is stored, and the damage is returned
        for the engine to count and log. Nothing read is ever guessed at."""
        parsed: list[SessionEntry] = []
        first_error: Exception | None = None
        for raw in entries:
            try:
                parsed.append(SessionEntry.from_json(raw))
            except ValueError as error:
                first_error = first_error or error
        try:
            session = cls._restored(orjson.loads(header) if isinstance(header, bytes) else header, parsed)
        except _UNREADABLE as error:
            return cls._started_over(shopper_id, len(entries), error)
        if first_error is None:
            return session, None
        session._rewrite = True
        return session, RestoreDamage(len(entries) - len(parsed), header_lost=False, why=_why(first_error))

    @classmethod
    def _started_over(
        cls, shopper_id: str, entries: int, error: Exception
    ) -> tuple[ShopperSession, RestoreDamage]:
        session = cls(shopper_id)
        session._rewrite = True  # the first save replaces the stored log
        return session, RestoreDamage(entries, header_lost=True, why=_why(error))

    @classmethod
    def restore(cls, header: dict[str, Any], entries: list[bytes]) -> ShopperSession:
        """Rebuild from a header and stored entries in any order (they carry their sort key)."""
        return cls._restored(header, [SessionEntry.from_json(raw) for raw in entries])

    @classmethod
    def _restored(cls, header: dict[str, Any], parsed: list[SessionEntry]) -> ShopperSession:
        parsed.sort(key=lambda e: e.sort_key)
        pending = header.get("pending")
        session = cls(
            shopper_id=header["shopper_id"],
            entries=parsed,
            seq=header["seq"],
            epoch=header.get("epoch", 0),
            arrivals=header["arrivals"],
            last_prompt_ts=header["last_prompt_ts"],
            pending=None if pending is None else PendingTrigger(pending[0], pending[1]),
            trimmed_ids=deque(header.get("trimmed_ids", [])),
            last_log_tokens=header.get("last_log_tokens", 0),
            trimmed_since_prompt=header.get("trimmed_since_prompt", False),
            unprompted_trimmed_ids=list(header.get("unprompted_trimmed_ids", [])),
            unprompted_trimmed=header.get("unprompted_trimmed", 0),
        )
        newest_in_log = max((e.event.ts for e in parsed), default=0.0)
        session.newest_ts = max(header.get("newest_ts", 0.0), newest_in_log)  # older headers lack it
        session._ids = {e.event.event_id for e in parsed} | set(session.trimmed_ids)
        session._rewrite = any(e.legacy for e in parsed)  # store the log again without ignored fields
        return session


_UNREADABLE = (ValueError, KeyError, TypeError, IndexError, AttributeError)
"""What reading a stored header this code does not know raises (a missing key, a wrong type, a field
of another shape); ``ValueError`` covers JSON, msgspec, pydantic and ``MalformedEvent``."""


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:160]}"


@dataclass(frozen=True, slots=True)
class RestoreDamage:
    """What ``ShopperSession.salvage`` could not read of a stored session."""

    entries_dropped: int
    """Stored entries left out: every entry when the header was lost, since the log is replaced."""
    header_lost: bool
    """The header was unreadable: the shopper started over as a new session."""
    why: str
    """The first error met, for the log line."""
