"""Routing policies, one module each, chosen by name (``ClientConfig.policy``) and configured with one
typed settings model per policy (``ClientConfig.policy_settings``, a union tagged by ``policy``, as
SGLang's router has one config type per policy)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from llm_client.routing.base import Feedback, RouteOutcome, RouteRequest, RoutingPolicy
from llm_client.routing.least_outstanding import LeastOutstandingPolicy, LeastOutstandingSettings
from llm_client.routing.pd_aware import PdAwarePolicy, PdAwareSettings
from llm_client.routing.predicted_ttft import PredictedTtftPolicy, PredictedTtftSettings
from llm_client.routing.prefix_aware import PrefixAwarePolicy, PrefixAwareSettings
from llm_client.routing.round_robin import RoundRobinPolicy, RoundRobinSettings
from llm_client.routing.session_affinity import SessionAffinityPolicy, SessionAffinitySettings
from prompt_assembly.errors import ConfigurationError

POLICIES: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        LeastOutstandingPolicy,
        SessionAffinityPolicy,
        PrefixAwarePolicy,
        PdAwarePolicy,
        PredictedTtftPolicy,
    )
}

PolicyName = Literal[
    "round_robin", "least_outstanding", "session_affinity", "prefix_aware", "pd_aware", "predicted_ttft"
]

PolicySettings = Annotated[
    RoundRobinSettings
    | LeastOutstandingSettings
    | SessionAffinitySettings
    | PrefixAwareSettings
    | PdAwareSettings
    | PredictedTtftSettings,
    Field(discriminator="policy"),
]
"""One policy's typed settings; the ``policy`` field says which."""


def make_policy(policy: str | PolicySettings, **knobs: Any) -> RoutingPolicy:
    """A policy from its settings, or from its name and keyword knobs (validated by its settings model,
    so a wrong name or knob raises ``ValueError``)."""
    name = policy if isinstance(policy, str) else policy.policy
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigurationError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
    base = {"policy": name} if isinstance(policy, str) else policy.model_dump()
    settings = cls.settings_type.model_validate({**base, **knobs})
    built: RoutingPolicy = cls(settings)
    return built


__all__ = [
    "POLICIES",
    "Feedback",
    "PolicyName",
    "PolicySettings",
    "RouteOutcome",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
