"""Retry budget and backoff.

The budget is a token bucket filled by successful first attempts (``budget_ratio`` tokens each) and
drained by retries, so in an outage retries add at most ``budget_ratio`` extra load instead of
multiplying it by ``max_attempts`` (the retry-storm failure mode).
"""

from __future__ import annotations

import random

from llm_client.config import RetrySettings


class RetryBudget:
    def __init__(self, settings: RetrySettings) -> None:
        self._settings = settings
        self._tokens = settings.budget_min_tokens
        self._cap = max(settings.budget_min_tokens, 100.0)

    def on_request(self) -> None:
        self._tokens = min(self._cap, self._tokens + self._settings.budget_ratio)

    def try_spend(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


def backoff_s(attempt: int, settings: RetrySettings, rng: random.Random) -> float:
    """Full-jitter exponential backoff (AWS architecture blog): uniform in [0, base * 2**attempt]."""
    ceiling = min(settings.backoff_max_s, settings.backoff_base_s * (2**attempt))
    return rng.uniform(0, ceiling)
