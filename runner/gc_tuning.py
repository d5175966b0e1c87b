"""Garbage-collector settings for a long ingest loop.

Why: the runner keeps every live shopper's session in memory, so most objects it allocates per event
(the parsed event, its product snapshot, the session entry) live on. CPython's cyclic collector
counts those allocations and, with its default thresholds (700 young objects), runs a young
collection every few events and, as the heap grows, full collections that traverse every session. On
the ingest benchmark that cost about a third of the loop thread's CPU (``docs/benchmarks.md``, runner
profile). None of the per-event objects form reference cycles; reference counting frees them, so the
cyclic collector can run far less often without holding memory back.

What ``streaming_gc`` guarantees: objects alive when it starts (imports, settings, clients) are moved
to the permanent generation and never traversed again while it is active; young collections run every
``young_threshold`` allocations instead of 700; the collector is never disabled (cycles, e.g. from
asyncio tasks and exceptions, are still collected). On exit the previous thresholds are restored and
the frozen objects return to the oldest generation, so a process that runs a runner and then does
other work (a test) is left as it was; with several runners in one process, the last to stop restores.
The collector is process-wide state, so this module keeps the one process-wide count of who uses it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000
"""Young-generation threshold while ingesting. Measured on the runner ingest benchmark (60k events,
2,000 shoppers): 700 (CPython's default) 54-59 us of loop CPU per event, 20,000 39-45 us, with the
collector off 36-38 us; 50,000 was no better than 20,000."""


class _Nesting:
    """How many ``streaming_gc`` blocks are open in this process (several runners can share one, in
    tests): the settings are applied by the first to enter and restored by the last to leave."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: tuple[int, int, int] = gc.get_threshold()


_NESTING = _Nesting()


@contextlib.contextmanager
def streaming_gc(young_threshold: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """Collector settings for the duration of an ingest loop (see the module docstring)."""
    with _NESTING.lock:
        if _NESTING.depth == 0:
            _NESTING.saved = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(young_threshold, *_NESTING.saved[1:])
        _NESTING.depth += 1
    try:
        yield
    finally:
        with _NESTING.lock:
            _NESTING.depth -= 1
            if _NESTING.depth == 0:
                gc.set_threshold(*_NESTING.saved)
                gc.unfreeze()
