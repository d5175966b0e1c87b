"""Least outstanding requests: the baseline that gave 5x over naive balancing in a large assistant
deployment, because request durations vary by seconds. Ties go to the replica named first after a
rotating offset so equal replicas share load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest, StatelessPolicy


class LeastOutstandingPolicy(StatelessPolicy):
    name: ClassVar[str] = "least_outstanding"

    def __init__(self) -> None:
        self._rotation = 0

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        self._rotation += 1
        n = len(endpoints)
        return min(
            (endpoints[(i + self._rotation) % n] for i in range(n)),
            key=lambda e: e.outstanding,
        )
