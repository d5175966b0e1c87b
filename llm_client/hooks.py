"""Event hooks: callers observe each attempt (benchmarks count errors, services export metrics) without
patching the client's private methods, as httpx's ``event_hooks`` allow.

Hooks are plain synchronous callables run on the client's event loop, in registration order, right
where the attempt starts, fails or finishes; they must be quick and must not block. A hook that raises
is logged and skipped: observing a request can never fail it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_client.errors import LLMError
from llm_client.models import Completion

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of one request."""

    endpoint: str
    """The replica's name (``Endpoint.name``)."""
    routing_key: str
    number: int
    """1 for the first attempt of a request, 2 for its first retry, ..."""


@dataclass
class ClientHooks:
    attempt_started: list[Callable[[Attempt], None]] = field(default_factory=list)
    attempt_failed: list[Callable[[Attempt, LLMError], None]] = field(default_factory=list)
    """Every failed attempt, retried or not (``error.retryable`` says whether a retry may follow)."""
    attempt_finished: list[Callable[[Attempt, Completion], None]] = field(default_factory=list)

    @property
    def any(self) -> bool:
        """Whether any hook is registered (the client skips building ``Attempt`` records otherwise)."""
        return bool(self.attempt_started or self.attempt_failed or self.attempt_finished)

    def started(self, attempt: Attempt) -> None:
        for hook in self.attempt_started:
            _call(hook, attempt)

    def failed(self, attempt: Attempt, error: LLMError) -> None:
        for hook in self.attempt_failed:
            _call(hook, attempt, error)

    def finished(self, attempt: Attempt, completion: Completion) -> None:
        for hook in self.attempt_finished:
            _call(hook, attempt, completion)


def _call(hook: Callable[..., None], *args: object) -> None:
    try:
        hook(*args)
    except Exception:
        log.exception("client hook %r failed; the request goes on", hook)
