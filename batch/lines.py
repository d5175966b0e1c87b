"""Cutting a byte stream into lines (pure): linear time, and memory bounded by a line cap.

An input object arrives in chunks; a line may span many of them. Joining the pending bytes to each new
chunk (``pending + chunk``) copies the line so far once per chunk, which is quadratic in the line's
length, and keeps the whole line however long it is. ``LineSplitter`` keeps a line's pieces in a list
and joins them once, at its newline, and drops a line as soon as it grows past ``max_line_bytes``:
such a line comes out as an ``OversizedLine`` (its size, not its bytes), which a batch job turns into an
``oversized`` error row. Memory is at most the cap plus one chunk, whatever the input.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OversizedLine:
    """A line longer than the cap, in place of its bytes."""

    size: int
    """Bytes in the line, its newline excluded."""

    def __len__(self) -> int:
        return self.size


class LineSplitter:
    """Feed chunks, take complete lines (without their newline) in input order."""

    def __init__(self, max_line_bytes: int) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be at least 1")
        self.max_line_bytes = max_line_bytes
        self._pieces: list[bytes] = []
        self._size = 0
        self._oversized = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the current, unfinished line held in memory (never more than the cap)."""
        return sum(len(piece) for piece in self._pieces)

    def feed(self, chunk: bytes) -> list[bytes | OversizedLine]:
        """The lines that ``chunk`` completes; the rest of it waits for the next newline."""
        lines: list[bytes | OversizedLine] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            lines.append(self._take())
            start = end + 1
        if start < len(chunk):
            self._add(chunk[start:])
        return lines

    def end(self) -> list[bytes | OversizedLine]:
        """The last line when the input does not end with a newline (none when it does)."""
        return [self._take()] if self._size else []

    def _add(self, piece: bytes) -> None:
        self._size += len(piece)
        if self._oversized:
            return
        if self._size > self.max_line_bytes:
            self._oversized = True
            self._pieces.clear()
        elif piece:
            self._pieces.append(piece)

    def _take(self) -> bytes | OversizedLine:
        line: bytes | OversizedLine = OversizedLine(self._size) if self._oversized else b"".join(self._pieces)
        self._pieces.clear()
        self._size = 0
        self._oversized = False
        return line
