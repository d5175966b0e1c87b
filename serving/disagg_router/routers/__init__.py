"""TensorRT-LLM's disaggregated-server routers (``tensorrt_llm/serve/router.py``), one module each,
chosen by the YAML's ``router.type``: ``round_robin``, ``load_balancing``, ``kv_cache_aware``.
(TensorRT-LLM's ``conversation`` router is not rebuilt.)"""

from __future__ import annotations

from serving.disagg_router.config import RouterSettings
from serving.disagg_router.routers.base import Routed, Router
from serving.disagg_router.routers.kv_cache_aware import KvCacheAwareRouter, ServerScore
from serving.disagg_router.routers.load_balancing import LoadBalancingRouter
from serving.disagg_router.routers.request import PARTIAL_BLOCK, RouteRequest, block_hashes
from serving.disagg_router.routers.round_robin import RoundRobinRouter

__all__ = [
    "PARTIAL_BLOCK",
    "KvCacheAwareRouter",
    "LoadBalancingRouter",
    "RoundRobinRouter",
    "RouteRequest",
    "Routed",
    "Router",
    "ServerScore",
    "block_hashes",
    "make_router",
]


def make_router(settings: RouterSettings, servers: list[str]) -> Router:
    """``create_router``: the router ``settings.type`` names, over ``servers``."""
    if settings.type == "kv_cache_aware":
        return KvCacheAwareRouter(
            servers,
            use_tokens=settings.use_tokens,
            max_batch_size=settings.max_batch_size,
            tokens_per_block=settings.tokens_per_block,
            backfill_block_hashes_on_finish=settings.backfill_block_hashes_on_finish,
        )
    if settings.type == "load_balancing":
        return LoadBalancingRouter(servers, use_tokens=settings.use_tokens)
    return RoundRobinRouter(servers)
