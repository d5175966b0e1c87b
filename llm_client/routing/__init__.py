"""Routing policies, one module each, chosen by name (``ClientConfig.policy``)."""

from __future__ import annotations

from typing import Any

from llm_client.routing.base import RouteOutcome, RouteRequest, RoutingPolicy
from llm_client.routing.least_outstanding import LeastOutstandingPolicy
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from llm_client.routing.round_robin import RoundRobinPolicy
from llm_client.routing.session_affinity import SessionAffinityPolicy

POLICIES: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (RoundRobinPolicy, LeastOutstandingPolicy, SessionAffinityPolicy, PrefixAwarePolicy)
}


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
    policy: RoutingPolicy = cls(**options)
    return policy


__all__ = ["POLICIES", "RouteOutcome", "RouteRequest", "RoutingPolicy", "make_policy"]
