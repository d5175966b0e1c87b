"""Round-robin: the naive baseline. Spreads load evenly by count, ignores caches and request sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest, StatelessPolicy


class RoundRobinSettings(BaseModel):
    """No knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["round_robin"] = "round_robin"


class RoundRobinPolicy(StatelessPolicy):
    name: ClassVar[str] = "round_robin"
    settings_type: ClassVar[type[BaseModel]] = RoundRobinSettings

    def __init__(self, settings: RoundRobinSettings | None = None) -> None:
        self.settings = settings or RoundRobinSettings()
        self._next = 0

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        endpoint = endpoints[self._next % len(endpoints)]
        self._next += 1
        return endpoint
