"""The one dead-letter record both engines write: bounded whatever came in, deterministic, and the
original recoverable (text as text, bytes as base64, a tombstone as null) with its size and hash."""

from __future__ import annotations

import base64
import hashlib

from hypothesis import given
from hypothesis import strategies as st

from pipeline.dead_letter import (
    FORMAT,
    MAX_REASON_CHARS,
    DeadLetter,
    dead_letter,
    is_dead_letter,
    minimal_dead_letter,
)


def test_text_stays_text_and_bytes_become_base64() -> None:
    text = dead_letter(b'{"a":', "invalid JSON", topic="t", partition=3, offset=9, timestamp_ms=5)
    assert (text.original, text.original_encoding, text.partition, text.offset) == ('{"a":', "utf-8", 3, 9)
    binary = dead_letter(b"\xff\x00", "invalid JSON")
    assert binary.original_encoding == "base64"
    assert base64.b64decode(binary.original or "") == b"\xff\x00"
    assert binary.original_sha256 == hashlib.sha256(b"\xff\x00").hexdigest()


def test_a_tombstone_has_no_original() -> None:
    letter = dead_letter(None, "empty message")
    assert letter.original is None and letter.original_encoding is None and letter.original_size == 0


def test_a_large_original_is_cut_with_size_and_hash_kept() -> None:
    value = b'{"x": "' + b"y" * 2_000_000 + b'"}'
    letter = dead_letter(value, "record too large", max_original_bytes=1024)
    assert letter.truncated and letter.original_size == len(value)
    assert letter.original == value[:1024].decode()
    assert letter.original_sha256 == hashlib.sha256(value).hexdigest()
    assert len(letter.to_bytes()) < 2 * 1024 + 1024


def test_a_cut_never_splits_a_character_into_garbage() -> None:
    value = ("é" * 1000).encode()  # two bytes each: a cut at an odd byte splits one
    letter = dead_letter(value, "too long", max_original_bytes=1001)
    assert letter.original_encoding == "utf-8" and letter.original == "é" * 500


def test_the_same_input_gives_the_same_bytes() -> None:
    def once() -> bytes:
        return dead_letter(b"\x00junk", "invalid JSON", topic="t", partition=1, offset=2).to_bytes()

    assert once() == once()
    assert is_dead_letter(once()) and not is_dead_letter(b'{"kind": "insight"}')
    assert DeadLetter.from_bytes(once()).format == FORMAT


def test_the_minimal_record_drops_only_the_original() -> None:
    letter = dead_letter(b"x" * 100, "bad", topic="t", partition=0, offset=7)
    small = minimal_dead_letter(letter, "DLQ refused the size")
    assert small.original is None and small.original_sha256 == letter.original_sha256
    assert (small.topic, small.partition, small.offset) == ("t", 0, 7)
    assert "DLQ refused the size" in small.reason


@given(st.one_of(st.none(), st.binary(max_size=5000)), st.text(max_size=3000), st.integers(0, 2048))
def test_any_input_gives_a_bounded_valid_record(value: bytes | None, reason: str, limit: int) -> None:
    letter = dead_letter(value, reason, max_original_bytes=limit)
    raw = letter.to_bytes()
    # JSON escapes a control character as six bytes: the worst case of text and reason alike.
    assert len(raw) <= 6 * limit + 6 * MAX_REASON_CHARS + 1024
    assert DeadLetter.from_bytes(raw) == letter
    if value is not None:
        assert letter.original_size == len(value)
        assert letter.original_sha256 == hashlib.sha256(value).hexdigest()
