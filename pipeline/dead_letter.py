"""The dead-letter record: one format, one module, written byte for byte the same by both engines.

A record the gate rejects (``prompt_assembly.events.parse_event``) becomes one dead letter on the DLQ
topic with the reason and where it came from (topic, partition, offset, the Kafka timestamp).

Bounded whatever came in. A producer can put a record on the event topic that is as large as the broker
allows (1 MB by default, more where ``message.max.bytes`` was raised); wrapping all of it, base64 and
all, would make a dead letter larger than the DLQ accepts, and a dead letter that cannot be produced
used to stop the stream for good. So the original is cut to ``max_original_bytes`` (64 KiB by default)
and its full size and SHA-256 are kept. Why cut rather than park the whole original in S3: the dead
letter must not depend on a second store being up at the moment the stream meets a bad record, and the
whole original is still in the source topic at (topic, partition, offset) for its retention; the hash
identifies it there and in any copy. A dead letter is therefore at most about
``6 x (max_original_bytes + MAX_REASON_CHARS)`` bytes (the worst case is text of control characters,
which JSON escapes as ``\u0000``; base64 is 4/3), about 400 KB at the defaults, and usually
``4/3 x max_original_bytes``: under librdkafka's and the broker's 1 MB defaults.

Deterministic: no wall clock in the record (the time is the source record's own Kafka timestamp), keys
in a fixed order, so a replay or the other engine writes the same bytes for the same input.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Literal

import orjson
from pydantic import BaseModel, Field

FORMAT: Literal["shopper-dead-letter/1"] = "shopper-dead-letter/1"
DEFAULT_MAX_ORIGINAL_BYTES = 64 * 1024
MAX_REASON_CHARS = 1_000


class DeadLetter(BaseModel):
    """What a DLQ record holds. ``original`` is the (possibly cut) value, as text when the whole value
    is UTF-8, else base64; ``None`` for a tombstone (a record with no value)."""

    format: Literal["shopper-dead-letter/1"] = FORMAT
    reason: str
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    timestamp_ms: int | None = Field(None, description="the source record's Kafka timestamp")
    original: str | None
    original_encoding: Literal["utf-8", "base64"] | None
    original_size: int = Field(description="bytes of the whole original value")
    original_sha256: str | None = Field(description="of the whole original value; None for a tombstone")
    truncated: bool = Field(description="original holds only the first max_original_bytes")

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump())

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> DeadLetter:
        return cls.model_validate_json(raw)


def is_dead_letter(raw: bytes | str) -> bool:
    """Tells a dead letter from any other JSON record on a mixed stream, by its format tag."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def dead_letter(
    value: bytes | None,
    reason: str,
    *,
    topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    timestamp_ms: int | None = None,
    max_original_bytes: int = DEFAULT_MAX_ORIGINAL_BYTES,
) -> DeadLetter:
    """The dead letter of one rejected record; never raises for any ``value``."""
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    source = {"topic": topic, "partition": partition, "offset": offset, "timestamp_ms": timestamp_ms}
    if value is None:
        return DeadLetter(
            reason=reason,
            **source,
            original=None,
            original_encoding=None,
            original_size=0,
            original_sha256=None,
            truncated=False,
        )
    value = bytes(value)
    kept = value[: max(0, max_original_bytes)]
    original: str
    encoding: Literal["utf-8", "base64"]
    try:
        value.decode("utf-8")
        # A cut can split a multi-byte character: drop that partial character, keep the text.
        original, encoding = kept.decode("utf-8", errors="ignore"), "utf-8"
    except UnicodeDecodeError:
        original, encoding = base64.b64encode(kept).decode("ascii"), "base64"
    return DeadLetter(
        reason=reason,
        **source,
        original=original,
        original_encoding=encoding,
        original_size=len(value),
        original_sha256=hashlib.sha256(value).hexdigest(),
        truncated=len(kept) < len(value),
    )


def minimal_dead_letter(letter: DeadLetter, why: str) -> DeadLetter:
    """The fallback when a dead letter still cannot be produced (a DLQ with a tiny limit): the same
    record without the original, which the hash and the source position still identify."""
    return letter.model_copy(
        update={
            "original": None,
            "truncated": letter.original is not None,
            "reason": f"{letter.reason} ({why})",
        }
    )
