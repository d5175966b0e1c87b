"""Wiring: S3 store, Redis, LLM client and endpoint pool for a batch worker, from settings.

``open_batch(...)`` is what the CLI, the tests and the benchmark use, so all three run the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

from batch.config import BatchSettings
from batch.pool import EndpointPool
from batch.storage import JobStore
from batch.worker import BatchWorker
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from sinks.config import SinkSettings


def batch_client_config(
    endpoints: list[str], model: str, settings: BatchSettings, **overrides: object
) -> ClientConfig:
    """LLM client settings for a throughput pool: no streaming (less CPU per call), least
    outstanding requests (durations vary with document length), no client-side concurrency cap (the
    pool's adaptive limit is the cap)."""
    options: dict[str, object] = {
        "endpoints": endpoints,
        "model": model,
        "policy": "least_outstanding",
        "stream": False,
        "max_in_flight": 1_000_000,
        "timeouts": {
            "connect_s": 2.0,
            "attempt_s": settings.call_deadline_s,
            "deadline_s": settings.call_deadline_s,
        },
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]


@dataclass
class BatchRuntime:
    settings: BatchSettings
    sinks: SinkSettings
    store: JobStore
    redis: aioredis.Redis
    client: LLMClient
    pool: EndpointPool

    def worker(self, worker_id: str | None = None) -> BatchWorker:
        return BatchWorker(
            self.settings,
            store=self.store,
            redis=self.redis,
            pool=self.pool,
            key_prefix=self.sinks.redis_key_prefix,
            worker_id=worker_id,
        )


@contextlib.asynccontextmanager
async def open_batch(
    settings: BatchSettings,
    sinks: SinkSettings,
    llm: ClientConfig,
    *,
    fixed_limit: int | None = None,
    pool_name: str = "batch",
) -> AsyncIterator[BatchRuntime]:
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(JobStore(sinks, settings.jobs_prefix))
        redis = sinks.redis_client()
        stack.push_async_callback(redis.aclose)
        client = await stack.enter_async_context(LLMClient(llm))
        pool = EndpointPool(
            pool_name,
            client,
            aimd=settings.aimd,
            per_replica_budget=settings.per_replica_budget,
            fixed_limit=fixed_limit,
        )
        yield BatchRuntime(settings, sinks, store, redis, client, pool)
