"""Errors of the result sinks (see the tree in ``prompt_assembly.errors``)."""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class SinkError(ShopperError):
    """A sink could not make results durable. Engines retry it under ``SinkRetry`` and, past that,
    stop without committing (a restart replays from the last durable point)."""


class SinkWriteFailed(SinkError):
    """The destination refused or did not acknowledge results; names the sink and the first reason."""
