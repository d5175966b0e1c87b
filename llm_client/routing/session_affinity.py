"""Session affinity: rendezvous (highest-random-weight) hashing of the session key, with bounded load.

- Deterministic: a key maps to the same replica while the set of replicas is the same.
- Minimal movement: when a replica leaves, only its keys move (each to its own next choice), and when
  it comes back they return; no ring to rebalance.
- Bounded load (Mirrokni et al., "consistent hashing with bounded loads"): a replica already holding
  more than ``load_factor`` x the mean outstanding requests (and at least ``min_load_bound``) is skipped
  for the key's next choice, so a hot shopper cannot pile requests onto one replica. The floor keeps a
  nearly idle fleet from scattering shoppers: without it the bound was 1 whenever few requests were in
  flight, and a shopper whose previous prompt was still at its replica was sent to an idle one, cold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest, StatelessPolicy


def rendezvous_order(key: str, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """Endpoints in the key's preference order (highest hash weight first)."""
    return sorted(
        endpoints,
        key=lambda e: xxhash.xxh64_intdigest(f"{key}\x00{e.name}".encode()),
        reverse=True,
    )


class SessionAffinitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["session_affinity"] = "session_affinity"
    load_factor: float = Field(
        1.25, ge=1, description="skip a replica with this x the mean outstanding requests (bounded load)"
    )
    min_load_bound: int = Field(
        2, ge=1, description="the bound never drops below this (a nearly idle fleet does not scatter a "
        "shopper whose previous prompt is still in flight)"
    )  # fmt: skip


class SessionAffinityPolicy(StatelessPolicy):
    name: ClassVar[str] = "session_affinity"
    settings_type: ClassVar[type[BaseModel]] = SessionAffinitySettings

    def __init__(self, settings: SessionAffinitySettings | None = None, **knobs: float) -> None:
        if settings is None or knobs:
            base = settings.model_dump() if settings is not None else {}
            settings = SessionAffinitySettings.model_validate({**base, **knobs})
        self.settings = settings
        self.load_factor = self.settings.load_factor
        self.min_load_bound = self.settings.min_load_bound

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        total = sum(e.outstanding for e in endpoints) + 1
        bound = max(self.min_load_bound, math.ceil(self.load_factor * total / len(endpoints)))
        ordered = rendezvous_order(request.key, endpoints)
        for endpoint in ordered:
            if endpoint.outstanding < bound:
                return endpoint
        return ordered[0]
