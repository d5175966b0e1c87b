"""Failures in the log, throttled: the counters' companion. A counter says how often something
failed, its line says why, at most once per reason per interval however fast the failures come."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

LOG_INTERVAL_S = 10.0
"""At most one line per reason this often: under an outage a failure recurs on every request."""


@dataclass
class ThrottledLog:
    """Warnings, at most one line per reason per ``interval_s``, each saying how many of that reason
    were left out since the one before. Under an outage every request fails the same way (hundreds a
    second): a line each would bury every other line and cost more than the request, while none left
    an operator with a rising counter and no reason. Left-out failures are counted, not formatted: a
    line is built only when one is written. The reasons are the caller's few constants, so what is kept
    per reason stays bounded."""

    logger: logging.Logger
    interval_s: float = LOG_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _left_out: dict[str, int] = field(default_factory=dict)

    def warning(self, reason: str, message: str, *args: object) -> None:
        """Log ``message % args`` tagged with ``reason``, unless ``reason`` was logged within the
        interval (then it is only counted)."""
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._left_out[reason] = self._left_out.get(reason, 0) + 1
            return
        self._last[reason] = now
        left_out = self._left_out.pop(reason, 0)
        if last is None or not left_out:
            self.logger.warning(f"{message} [%s]", *args, reason, stacklevel=2)
        else:
            self.logger.warning(
                f"{message} [%s; %d more left out in the %.0f s since the last line]",
                *args,
                reason,
                left_out,
                now - last,
                stacklevel=2,  # the caller's line, not this one
            )
