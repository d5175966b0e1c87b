"""``load_balancing``: the least loaded server (TensorRT-LLM's ``LoadBalancingRouter`` with
``LoadBalancingMixin._select_least_loaded``). The load is active requests, or active prompt tokens with
``use_tokens``; ties go round robin over the tied servers, one counter for the router's lifetime."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.disagg_router.errors import NoServerAvailable
from serving.disagg_router.routers.base import LoadTable, Routed
from serving.disagg_router.routers.request import RouteRequest


@dataclass
class LoadBalancingRouter:
    servers: list[str]
    use_tokens: bool = False
    table: LoadTable = field(init=False)
    _rr: int = 0

    def __post_init__(self) -> None:
        self.table = LoadTable(self.servers, self.use_tokens)

    def least_loaded(self, exclude: str | None = None) -> str:
        candidates = [s for s in self.servers if s != exclude]
        if not candidates:
            raise NoServerAvailable(f"No available servers after excluding {exclude}")
        loads = {s: self.table.load(s) for s in candidates}
        least = min(loads.values())
        tied = [s for s in candidates if loads[s] == least]
        server = tied[self._rr % len(tied)]
        self._rr += 1
        return server

    def choose(self, request: RouteRequest, exclude: str | None = None) -> Routed:
        server = self.least_loaded(exclude)
        tokens = self.table.register(server, request)
        return Routed(server, load_tokens=tokens, prompt_tokens=request.prompt_tokens)

    def finish(self, routed: Routed, *, success: bool = True) -> None:
        self.table.unregister(routed)
