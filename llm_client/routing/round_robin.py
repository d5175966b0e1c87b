"""Round-robin: the naive baseline. Spreads load evenly by count, ignores caches and request sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest, StatelessPolicy


class RoundRobinPolicy(StatelessPolicy):
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        endpoint = endpoints[self._next % len(endpoints)]
        self._next += 1
        return endpoint
