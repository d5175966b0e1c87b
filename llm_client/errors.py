"""Typed client errors. Each says what failed and where, so a person (or a retry rule) can act."""

from __future__ import annotations


class LLMError(Exception):
    """Base class. ``retryable`` tells the client whether another attempt, elsewhere, may succeed."""

    retryable = False

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message if endpoint is None else f"{message} (endpoint {endpoint})")
        self.endpoint = endpoint
        self.attempts = 0
        """Attempts the client really made for the request that failed (set by the client)."""


class EndpointUnavailable(LLMError):
    """Connection refused/reset, or a 5xx/429 answer: try another replica."""

    retryable = True


class AttemptTimeout(LLMError):
    """One attempt took longer than its share of the deadline."""

    retryable = True


class NoHealthyEndpoint(LLMError):
    """Every configured replica is ejected; the health checker re-admits them when they answer."""

    retryable = True


class DeadlineExceeded(LLMError):
    """The request's overall deadline passed, retries included."""


class RetryBudgetExhausted(LLMError):
    """Retries are capped at a fraction of requests so that an outage does not multiply the load."""


class BadRequest(LLMError):
    """The server rejected the request itself (4xx other than 429): retrying cannot help."""


class InvalidAnswer(LLMError):
    """The model answered, but not with what the caller's schema requires."""
