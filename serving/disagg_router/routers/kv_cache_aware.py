"""``kv_cache_aware``: the server holding most of the prompt, less its load (TensorRT-LLM's
``KvCacheAwareRouter``, ``tensorrt_llm/serve/router.py``).

Per server::

    matched_tokens = tokens_per_block x (leading prompt blocks in the server's block table)
    padded_tokens  = max(tokens_per_block x prompt blocks, 1)
    score          = matched_tokens / padded_tokens - active_requests / max_batch_size

The highest score wins; servers tied at it take turns (round robin over the tied ones, one counter for
the router's lifetime; older TensorRT-LLM, e.g. commit 3e53e4a, took the first of them). The load term
is always active *requests*, ``use_tokens`` or not. Blocks are the request's as
``routers.request.block_hashes`` lays them out; a match stops at the first block a server lacks.

A server's block table is learned from its KV cache events (``POST /kv_cache_events``, which drains its
buffer): ``stored`` adds the blocks, ``removed`` drops them; nothing else changes the table (``created``
and the simulator's ``cleared`` are ignored, as TensorRT-LLM ignores them, so a restarted server's old
blocks stay believed until removed). The front end polls a server's events each time a request finishes
there, not on a timer, as TensorRT-LLM's ``finish_request`` does; ``apply_events`` is that update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.disagg_router.errors import NoServerAvailable
from serving.disagg_router.routers.base import LoadTable, Routed
from serving.disagg_router.routers.request import RouteRequest, block_hashes


@dataclass(frozen=True, slots=True)
class ServerScore:
    server: str
    matched_tokens: int
    active_requests: int
    score: float


@dataclass
class KvCacheAwareRouter:
    servers: list[str]
    use_tokens: bool = False
    max_batch_size: int = 64
    tokens_per_block: int = 32
    backfill_block_hashes_on_finish: bool = False
    block_tables: dict[str, set[int]] = field(default_factory=dict)
    table: LoadTable = field(init=False)
    _rr: int = 0

    def __post_init__(self) -> None:
        self.table = LoadTable(self.servers, self.use_tokens)
        for server in self.servers:
            self.block_tables.setdefault(server, set())

    def matched_tokens(self, server: str, hashes: Sequence[int]) -> int:
        held = self.block_tables[server]
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += self.tokens_per_block
        return matched

    def scores(self, hashes: Sequence[int], exclude: str | None = None) -> list[ServerScore]:
        """Every candidate's score for a prompt's block hashes, in server order."""
        padded = max(len(hashes) * self.tokens_per_block, 1)
        out = []
        for server in self.servers:
            if server == exclude:
                continue
            matched = self.matched_tokens(server, hashes)
            active = self.table.loads[server].active_requests
            out.append(ServerScore(server, matched, active, matched / padded - active / self.max_batch_size))
        return out

    def choose(self, request: RouteRequest, exclude: str | None = None) -> Routed:
        hashes = block_hashes(request, self.tokens_per_block)
        scored = self.scores(hashes, exclude)
        if not scored:
            raise NoServerAvailable(f"No available servers after excluding {exclude}")
        best = max(s.score for s in scored)
        tied = [s for s in scored if s.score == best]
        winner = tied[self._rr % len(tied)]
        self._rr += 1
        tokens = self.table.register(winner.server, request)
        return Routed(winner.server, tokens, request.prompt_tokens, winner.matched_tokens, tuple(hashes))

    def finish(self, routed: Routed, *, success: bool = True) -> None:
        self.table.unregister(routed)
        if success and self.backfill_block_hashes_on_finish and routed.server in self.block_tables:
            self.block_tables[routed.server].update(routed.block_hashes)

    def apply_events(self, server: str, events: Iterable[dict[str, Any]]) -> None:
        """One poll's events of ``server`` (``{"event_id", "data": {...}}`` or the bare data)."""
        held = self.block_tables.get(server)
        if held is None:
            return
        for raw in events:
            event = raw.get("data", raw)
            if event.get("type") == "stored":
                held.update(block["block_hash"] for block in event.get("blocks", []))
            elif event.get("type") == "removed":
                held.difference_update(event.get("block_hashes", []))
