"""The runner's log lines, as text (default) or one JSON object a line (``RUNNER_LOG_FORMAT=json``)
for a log pipeline that parses fields: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``.

The runner logs few, whole lines (progress, rebalances, failures, dead letters it could not deliver);
the level is read from what the line says, so the call sites stay one ``log(str)``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal, TextIO

import orjson

LogFormat = Literal["text", "json"]
_LEVELS: tuple[tuple[str, str], ...] = (
    ("runner failing", "error"),
    ("dead letter NOT delivered", "error"),
    ("kafka error", "warning"),
    ("error record", "warning"),
    ("rebalance: results not durable", "warning"),
    ("rebalance: hand-over failed", "warning"),
    ("session state unreadable", "warning"),
)


def level_of(line: str) -> str:
    for start, level in _LEVELS:
        if line.startswith(start):
            return level
    return "warning" if "failed, retrying" in line else "info"


def line_logger(
    fmt: LogFormat, stream: TextIO | None = None, logger: str = "runner"
) -> Callable[[str], None]:
    """A ``log(line)`` writing to ``stream`` (stderr by default) in ``fmt``.

    Lines come from more than one thread (a rebalance callback runs inside the consumer's poll, off the
    event loop), so each line is one write under a lock: ``print`` writes the text and its newline
    separately, and two JSON records once landed on one line."""
    lock = threading.Lock()

    def write(line: str) -> None:
        out = stream or sys.stderr
        with lock:
            out.write(line + "\n")
            out.flush()

    def text(line: str) -> None:
        write(line)

    def json(line: str) -> None:
        record = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "level": level_of(line),
            "logger": logger,
            "msg": line,
        }
        write(orjson.dumps(record).decode())

    return json if fmt == "json" else text
