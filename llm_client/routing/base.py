"""The one interface every routing policy implements.

A policy picks a replica for a request from the routable endpoints and learns from what happened.
Policies are synchronous and do no I/O (the client calls them on the event loop, once per attempt), so
they are unit-testable and cheap. Adding a policy is adding a module with a class that has a unique
``name``, a settings model (``settings_type``: a pydantic model whose ``policy`` field is the policy's
name, so ``ClientConfig.policy_settings`` is a tagged union) and registering it in
``llm_client.routing.POLICIES``.

Policies never write an ``Endpoint`` (only the client does): what a policy learns that the client must
record (a replica found restarted) comes back from ``observe`` as ``Feedback``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from pydantic import BaseModel

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
    completion_tokens: int = 0
    first_token: bool = False
    """``ttft_ms`` is when a streamed answer's first token came. Otherwise (an answer not streamed) it is
    the whole answer's latency, decode included, and says nothing of the time to a first token."""


@dataclass(frozen=True, slots=True)
class Feedback:
    """What ``observe`` learned that the client records on the ``Endpoint``."""

    restart_detected: bool = False
    """The replica answered as if it had lost its KV cache (restarted)."""


NO_FEEDBACK = Feedback()


class RoutingPolicy(Protocol):
    name: ClassVar[str]
    settings_type: ClassVar[type[BaseModel]]

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        """Pick one of ``endpoints`` (non-empty, all routable, those already tried removed)."""
        ...

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        """Prefill work the policy expects on ``endpoint`` (used for load accounting)."""
        ...

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> Feedback:
        """Learn from an attempt that finished; never writes ``endpoint``."""
        ...

    def forget(self, endpoint: Endpoint) -> None:
        """``endpoint`` restarted or left: drop what is believed about its cache."""
        ...


@runtime_checkable
class KvEventConsumer(Protocol):
    """A policy that follows the replicas' KV cache events (``llm_client.kv_events`` polls them)."""

    @property
    def kv_event_poll_s(self) -> float | None:
        """Seconds between polls of each replica's ``POST /kv_cache_events``; None: events off."""
        ...

    def apply_kv_events(self, endpoint: Endpoint, events: Sequence[Any]) -> None:
        """Apply one poll's events (``llm_client.kv_events.KvCacheEvent``), oldest first."""
        ...


@runtime_checkable
class PrefillObserver(Protocol):
    """A policy that wants to know when an attempt's prefill is over: its first token streamed (or,
    for an answer that is not streamed, the attempt ended)."""

    def prefill_done(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The replica has computed ``request``'s prompt (its blocks are reusable from now on)."""
        ...

    def prefill_abandoned(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The attempt ended without a first token (cancelled, refused with a 4xx, the caller left):
        nothing is known to be computed, and no iteration is known to have ended."""
        ...

    def attempt_over(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The attempt on ``endpoint`` ended, whatever happened (answered, failed, cancelled by its
        caller's deadline): what the policy counted for it while in flight is released. Called once
        per attempt, after any ``observe``."""
        ...


def prefill_observer(policy: object) -> PrefillObserver | None:
    """``policy`` as a ``PrefillObserver``, or None. Asked per attempt on the hot path: an
    ``isinstance`` against a runtime-checkable protocol walks its members each time (~11 µs), so the
    answer is kept per policy class (the protocol has only methods, which live on the class)."""
    policy_class = type(policy)
    observes = _OBSERVES_PREFILL.get(policy_class)
    if observes is None:
        observes = _OBSERVES_PREFILL[policy_class] = issubclass(policy_class, PrefillObserver)
    return cast(PrefillObserver, policy) if observes else None


_OBSERVES_PREFILL: dict[type, bool] = {}
"""Per policy class: a pure function of the class, so keeping it process-wide shares nothing else."""


class StatelessPolicy:
    """Base for policies that keep no per-replica knowledge."""

    name: ClassVar[str] = "stateless"

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        return request.prompt_tokens

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> Feedback:
        return NO_FEEDBACK

    def forget(self, endpoint: Endpoint) -> None:
        return None
