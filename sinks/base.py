"""The small protocol every result sink implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prompt_assembly.records import EnrichmentResult


class ResultSink(Protocol):
    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        """Make ``results`` durable (or buffered until ``flush``); idempotent per ``request_id``."""
        ...

    async def flush(self) -> None:
        """Everything written so far is durable when this returns."""
        ...

    async def close(self) -> None: ...
