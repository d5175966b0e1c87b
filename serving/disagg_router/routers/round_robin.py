"""``round_robin``: the servers in turn (TensorRT-LLM's ``RoundRobinRouter``). With ``exclude`` it
skips that server once; if the next one is excluded too there is nobody left."""

from __future__ import annotations

from dataclasses import dataclass

from serving.disagg_router.errors import NoServerAvailable
from serving.disagg_router.routers.base import Routed
from serving.disagg_router.routers.request import RouteRequest


@dataclass
class RoundRobinRouter:
    servers: list[str]
    _index: int = 0

    def choose(self, request: RouteRequest, exclude: str | None = None) -> Routed:
        if not self.servers:
            raise NoServerAvailable("No servers available")
        server = self._next()
        if exclude and server == exclude:
            server = self._next()
            if server == exclude:
                raise NoServerAvailable(f"No available servers after excluding {exclude}")
        return Routed(server, prompt_tokens=request.prompt_tokens)

    def finish(self, routed: Routed, *, success: bool = True) -> None:
        return None

    def _next(self) -> str:
        server = self.servers[self._index % len(self.servers)]
        self._index += 1
        return server
