"""Redis side of running jobs: the worker's lease on a job, and live progress for ``status``.

The lease (``{prefix}batch:lease:{job_id}``, value = the worker's token, with a TTL) makes sure one
worker at a time runs a job, so two workers never write one shard concurrently. It is refreshed at
every checkpoint; a killed worker's lease expires after ``lease_ttl_s`` and the job becomes
resumable. Release and refresh only act when the token still matches (compare-and-set in Lua).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis.asyncio as aioredis

from sinks.keys import RedisKeys

_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class JobLease:
    def __init__(self, redis: aioredis.Redis, prefix: str, job_id: str, token: str, ttl_s: float) -> None:
        self.redis = redis
        self.key = RedisKeys(prefix).batch_lease(job_id)
        self.token = token
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self._refresh = redis.register_script(_REFRESH)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self) -> bool:
        return bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def refresh(self) -> bool:
        """False when the lease was lost (expired and taken): the worker must stop writing."""
        return bool(await self._refresh(keys=[self.key], args=[self.token, self.ttl_ms]))

    async def release(self) -> None:
        await self._release(keys=[self.key], args=[self.token])

    async def holder(self) -> str | None:
        raw = await self.redis.get(self.key)
        return None if raw is None else raw.decode()


def progress_key(prefix: str, job_id: str) -> str:
    return RedisKeys(prefix).batch_progress(job_id)


async def publish_progress(
    redis: aioredis.Redis, prefix: str, job_id: str, fields: dict[str, Any], ttl_s: float
) -> None:
    payload = orjson.dumps({**fields, "published_at": time.time()})
    await redis.set(progress_key(prefix, job_id), payload, px=max(int(ttl_s * 1000), 1))


async def read_progress(redis: aioredis.Redis, prefix: str, job_id: str) -> dict[str, Any] | None:
    raw = await redis.get(progress_key(prefix, job_id))
    return None if raw is None else dict(orjson.loads(raw))
