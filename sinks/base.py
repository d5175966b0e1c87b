"""The protocol every result sink implements, so that an engine holds a list of sinks and names none.

An engine calls ``open`` once, ``write`` for each batch of results, and ``flush`` at each durable
point (``pipeline.checkpoint.Checkpoint``); ``due`` lets a buffering sink ask for an early flush.
A new sink is one module implementing this plus one entry in ``sinks.registry``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prompt_assembly.records import EnrichmentResult


class ResultSink(Protocol):
    @property
    def name(self) -> str:
        """Its registry name: in logs, metrics and errors."""
        ...

    async def open(self) -> None:
        """Make the destination ready (a bucket, a connection); idempotent, retried by the engine."""
        ...

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        """Make ``results`` durable, or buffer them until ``flush``; idempotent per ``request_id``.
        A retried write must never store a result twice where readers cannot dedupe it."""
        ...

    def due(self) -> bool:
        """True when buffered results should be flushed now (size or age), before the next durable
        point; a sink that buffers nothing answers False."""
        ...

    async def flush(self) -> None:
        """Everything written so far is durable when this returns; raises if it is not."""
        ...

    async def close(self) -> None:
        """Flush what can be flushed and release connections."""
        ...
