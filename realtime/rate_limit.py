"""Per-client rate limiting: one token bucket per client, in bounded memory (pure, injectable clock)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``rate_per_s`` tokens a second up to ``burst``; a request takes one."""

    rate_per_s: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """0.0 when a token was taken; otherwise the seconds until one will be there (nothing taken)."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class ClientRateLimiter:
    """A token bucket per client key (an API key's id or a remote address).

    At most ``max_clients`` buckets are kept (least recently used go first), so a flood of distinct
    addresses costs bounded memory; a forgotten client starts again with a full bucket, which errs on
    the side of serving. ``rate_per_s`` <= 0 turns limiting off.
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = max(burst, 1)
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def retry_after_s(self, client: str) -> float:
        """Take a token for ``client``: 0.0 if allowed, else the wait before the next one."""
        if not self.enabled:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, self.burst, now)
            self._buckets[client] = bucket
            if len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
        return bucket.take(now)


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` in whole seconds, at least 1."""
    return str(max(1, math.ceil(wait_s)))
