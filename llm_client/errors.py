"""Typed client errors. Each says what failed and where, so a person (or a retry rule) can act.

The tree (the project's whole hierarchy is drawn in ``prompt_assembly.errors``)::

    LLMError
    ├── TransportError  (retryable)      the replica could not be reached, or broke off
    │   ├── EndpointUnavailable          refused, reset or cut off; a 5xx or 429
    │   │   ├── ConnectionFailed         ... at the connection: the replica is ejected at once
    │   │   └── Overloaded               ... a 429: alive and shedding load, never counted against it
    │   └── AttemptTimeout               one attempt ran past its share of the deadline
    ├── InvalidAnswer   (retried once)   a 2xx that is no usable answer: not JSON, the wrong shape or
    │   │                                types, empty, or not what the caller's schema requires
    │   └── AnswerTooLarge               ... more bytes than ``AnswerLimits`` allow
    ├── NoHealthyEndpoint (retryable)    every replica is ejected, drained or quarantined
    ├── DeadlineExceeded                 the call's deadline passed (waiting for a slot included)
    ├── RetryBudgetExhausted             retries are capped so an outage does not multiply the load
    ├── KvCacheGone                      P/D: the context server no longer holds the prompt's KV cache
    │                                    (transfer timeout, restart): the client prefills locally instead
    └── BadRequest                       a 4xx other than 429: the request itself is wrong

Every transport and parse failure becomes one of these in exactly two places:
``llm_client.transport.mapped_transport_errors`` (aiohttp, sockets, timeouts) and ``llm_client.answers``
(bytes to a ``Completion``). Nothing else (no ``TypeError`` from a wrong-typed answer, no aiohttp
``LineTooLong`` from a huge one) leaves the client.
"""

from __future__ import annotations

from typing import Literal

from prompt_assembly.errors import ShopperError

InvalidAnswerKind = Literal["too_large", "not_json", "wrong_shape", "empty", "schema"]
"""Why an answer was invalid; a small fixed set, so it can label metrics."""


class LLMError(ShopperError):
    """Base class. ``retryable`` tells the client whether another attempt, elsewhere, may succeed."""

    retryable = False

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message if endpoint is None else f"{message} (endpoint {endpoint})")
        self.endpoint = endpoint
        self.attempts = 0
        """Attempts the client really made for the request that failed (set by the client)."""


class TransportError(LLMError):
    """The replica could not be reached, or the exchange broke off: another replica may answer."""

    retryable = True


class EndpointUnavailable(TransportError):
    """Connection refused/reset, an answer cut off, or a 5xx/429 answer: try another replica.

    ``retry_after_s``: how long the server asked not to be sent the request again (its ``Retry-After``,
    on a 429 or 503; None when it said nothing). The client honours it when the retry would go back to
    that server (``llm_client.calls``)."""

    def __init__(
        self, message: str, *, endpoint: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, endpoint=endpoint)
        self.retry_after_s = retry_after_s


class Overloaded(EndpointUnavailable):
    """The server answered and refused for load (HTTP 429, as a gateway sheds overload): it is alive
    and did what it should, so nothing counts against its health (``Fleet.refused``). Counted as a
    failure, two in a row ejected a gateway until its ``/health`` answered, leaving a client with one
    gateway no replica at all. The retry goes to another replica, or back to it after its
    ``Retry-After``."""


class ConnectionFailed(EndpointUnavailable):
    """The connection itself failed (refused, reset, closed mid-answer): the replica is ejected at once
    and re-admitted when its ``/health`` answers."""


class AttemptTimeout(TransportError):
    """One attempt took longer than its share of the deadline."""


class InvalidAnswer(LLMError):
    """The replica answered (2xx), but not with a usable answer.

    Retried once on another replica (a healthy replica answers the same prompt well), and counted
    against the replica's answer health (``llm_client.answer_health``): one that keeps sending them is
    quarantined. ``raw`` keeps the start of what came, for the error record."""

    retryable = True

    def __init__(
        self, message: str, *, kind: InvalidAnswerKind, endpoint: str | None = None, raw: str | None = None
    ) -> None:
        super().__init__(message, endpoint=endpoint)
        self.kind: InvalidAnswerKind = kind
        self.raw = None if raw is None else raw[:2000]


class AnswerTooLarge(InvalidAnswer):
    """More bytes (or a longer stream line) than ``AnswerLimits`` allow; reading stopped at the limit."""

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message, kind="too_large", endpoint=endpoint)


class NoHealthyEndpoint(LLMError):
    """Every configured replica is ejected; the health checker re-admits them when they answer."""

    retryable = True


class DeadlineExceeded(LLMError):
    """The request's overall deadline passed, retries and the wait for a concurrency slot included."""


class RetryBudgetExhausted(LLMError):
    """Retries are capped at a fraction of requests so that an outage does not multiply the load."""


class BadRequest(LLMError):
    """The server rejected the request itself (4xx other than 429): retrying cannot help."""


class SupersededByNewer(BadRequest):
    """A gateway in front of the replicas refused the call (HTTP 409 with ``x-gateway-superseded-by``):
    it had already seen a newer version of the call's session. A caller replaying after a crash meets
    this for the prompts its dead process had superseded there; it is an outcome, not a failure."""

    def __init__(self, message: str, *, newer_version: str, endpoint: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint)
        self.newer_version = newer_version
        """The session version that superseded it (``N`` or ``EPOCH.N``)."""


class Withdrawn(LLMError):
    """The replica left this client's fleet while the attempt ran, and the client cut the attempt (a
    capacity hand-off: ``LLMClient.set_endpoints`` with ``withdraw_after_s``). Not the replica's fault
    nor a sign of load: the call is moved to another replica at once, without spending an attempt or
    the retry budget."""

    retryable = True


class KvCacheGone(LLMError):
    """P/D disaggregation: a generation server could not pull the prompt's KV cache from the context
    server (pulled already, past the transfer timeout, or lost in a restart). Retrying the pull cannot
    help; the client redoes the prefill on the decode server instead, so the caller never sees this."""
