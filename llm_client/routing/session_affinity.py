"""Session affinity: rendezvous (highest-random-weight) hashing of the session key, with bounded load.

- Deterministic: a key maps to the same replica while the set of replicas is the same.
- Minimal movement: when a replica leaves, only its keys move (each to its own next choice), and when
  it comes back they return; no ring to rebalance.
- Bounded load (Mirrokni et al., "consistent hashing with bounded loads"): a replica already holding
  more than ``load_factor`` x the mean outstanding requests is skipped for the key's next choice, so a
  hot shopper cannot pile requests onto one replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest, StatelessPolicy


def rendezvous_order(key: str, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """Endpoints in the key's preference order (highest hash weight first)."""
    return sorted(
        endpoints,
        key=lambda e: xxhash.xxh64_intdigest(f"{key}\x00{e.name}".encode()),
        reverse=True,
    )


class SessionAffinityPolicy(StatelessPolicy):
    name: ClassVar[str] = "session_affinity"

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        self.load_factor = load_factor

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        total = sum(e.outstanding for e in endpoints) + 1
        bound = max(1, math.ceil(self.load_factor * total / len(endpoints)))
        ordered = rendezvous_order(request.key, endpoints)
        for endpoint in ordered:
            if endpoint.outstanding < bound:
                return endpoint
        return ordered[0]
