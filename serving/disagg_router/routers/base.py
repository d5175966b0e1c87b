"""The interface every router implements, and the load bookkeeping the load-aware ones share
(TensorRT-LLM's ``LoadBalancingMixin`` and ``ServerState``).

Routers are plain synchronous objects: ``choose`` reserves a server for a request (adding its load) and
``finish`` gives it back. The front end calls ``finish`` exactly once per ``choose``, on success and on
failure, so loads return to zero when nothing is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from serving.disagg_router.routers.request import RouteRequest


@dataclass(frozen=True, slots=True)
class Routed:
    """One routing decision. ``matched_tokens`` and ``block_hashes`` are a ``kv_cache_aware``
    router's (TensorRT-LLM returns them as ``info["matches"]`` and ``info["block_hashes"]``)."""

    server: str
    load_tokens: int = 0
    """What ``choose`` added to the server's token load; ``finish`` takes it off."""
    prompt_tokens: int = 0
    matched_tokens: int = 0
    block_hashes: tuple[int, ...] = ()


class Router(Protocol):
    @property
    def servers(self) -> list[str]: ...

    def choose(self, request: RouteRequest, exclude: str | None = None) -> Routed:
        """Pick a server other than ``exclude`` and reserve it; raises ``NoServerAvailable`` or
        ``RouterRefusal``."""
        ...

    def finish(self, routed: Routed, *, success: bool = True) -> None:
        """The request is over on ``routed.server`` (answered, failed or cancelled)."""
        ...


@dataclass(slots=True)
class ServerLoad:
    active_requests: int = 0
    active_tokens: int = 0


@dataclass
class LoadTable:
    """Active requests and prompt tokens per server; ``use_tokens`` picks which one is "the load"."""

    servers: list[str]
    use_tokens: bool = False
    loads: dict[str, ServerLoad] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for server in self.servers:
            self.loads.setdefault(server, ServerLoad())

    def load(self, server: str) -> int:
        state = self.loads[server]
        return state.active_tokens if self.use_tokens else state.active_requests

    def register(self, server: str, request: RouteRequest) -> int:
        """Count a request on ``server``; the tokens it added (0 unless ``use_tokens``)."""
        tokens = request.load_tokens() if self.use_tokens else 0
        state = self.loads[server]
        state.active_requests += 1
        state.active_tokens += tokens
        return tokens

    def unregister(self, routed: Routed) -> None:
        state = self.loads.get(routed.server)
        if state is not None:
            state.active_requests -= 1
            state.active_tokens -= routed.load_tokens
