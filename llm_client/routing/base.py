"""The one interface every routing policy implements.

A policy picks a replica for a request from the routable endpoints and learns from what happened.
Policies are synchronous and do no I/O (the client calls them on the event loop, once per attempt), so
they are unit-testable and cheap. Adding a policy is adding a module with a class that has a unique
``name`` and registering it in ``llm_client.routing.POLICIES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from llm_client.endpoints import Endpoint


@dataclass(slots=True)
class RouteRequest:
    key: str
    """Session key (shopper id): what affinity policies hash."""
    prompt_text: str
    """The prompt as the server's prefix cache sees it (chat messages flattened)."""
    prompt_tokens: int
    max_tokens: int
    memo: dict[str, object] = field(default_factory=dict)
    """Scratch space for a policy between ``choose`` and ``observe`` (e.g. block hashes)."""


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_ms: float = 0.0
    ttft_ms: float = 0.0
    connection_failed: bool = False


class RoutingPolicy(Protocol):
    name: ClassVar[str]

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        """Pick one of ``endpoints`` (non-empty, all routable, those already tried removed)."""
        ...

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        """Prefill work the policy expects on ``endpoint`` (used for load accounting)."""
        ...

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
        """Feedback after an attempt finished."""
        ...

    def forget(self, endpoint: Endpoint) -> None:
        """``endpoint`` restarted or left: drop what is believed about its cache."""
        ...


class StatelessPolicy:
    """Base for policies that keep no per-replica knowledge."""

    name: ClassVar[str] = "stateless"

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        return request.prompt_tokens

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
        return None

    def forget(self, endpoint: Endpoint) -> None:
        return None
