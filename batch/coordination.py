"""Redis side of running jobs: the worker's lease on a job, and live progress for ``status``.

The lease (``{prefix}batch:lease:{job_id}``, value = the worker's token, with a TTL) makes sure one
worker at a time runs a job, so two workers never write one shard concurrently. It is refreshed at
every checkpoint and before every shard commit; a killed worker's lease expires after ``lease_ttl_s``
and the job becomes resumable. Release and refresh only act when the token still matches
(compare-and-set in Lua).

A worker writes only while it knows it holds the lease (``JobLease.still_held``): a refresh that finds
another token means the lease is lost for good, and a refresh that cannot reach Redis leaves the worker
only the rest of the last renewal's TTL, after which another worker may take the job.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

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
        self.job_id = job_id
        self.key = RedisKeys(prefix).batch_lease(job_id)
        self.token = token
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self._refresh = redis.register_script(_REFRESH)
        self._release = redis.register_script(_RELEASE)
        self._held_until = 0.0
        """Monotonic time before which no other worker can hold the lease: the start of the last
        successful acquire or refresh plus the TTL (the TTL began after that start, so this is early)."""
        self.lost: str | None = None
        """Why this worker must stop writing; once set, it stays set."""

    @property
    def held_until(self) -> float:
        """Monotonic time until which no other worker can hold the lease (``_held_until``)."""
        return self._held_until

    async def acquire(self) -> bool:
        started = time.monotonic()
        acquired = bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))
        if acquired:
            self._held_until, self.lost = started + self.ttl_ms / 1000, None
        return acquired

    async def refresh(self) -> bool:
        """False when the lease was lost (expired and taken): the worker must stop writing."""
        return bool(await self._refresh(keys=[self.key], args=[self.token, self.ttl_ms]))

    async def still_held(self) -> bool:
        """Renew the lease and say whether this worker may still write (manifest, parts, signals).

        False for good once another token holds the key. When Redis cannot be reached the renewal is
        tried for as long as the last one lasts, and the answer is False once it has run out: by then
        another worker may have taken the job, and two writers of one manifest is what the lease is for.
        """
        if self.lost is not None:
            return False
        started = time.monotonic()
        remaining = self._held_until - started
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                renewed = await self.refresh()
        except (RedisError, OSError, TimeoutError) as exc:
            if time.monotonic() < self._held_until:
                return True
            self.lost = (
                f"could not renew the lease on job {self.job_id} before it expired ({exc!r}); stopped "
                "writing, and the job resumes from its last checkpoint once a worker can take it"
            )
            return False
        if not renewed:
            self.lost = f"lost the lease on job {self.job_id}: another worker may be running it"
            return False
        self._held_until = started + self.ttl_ms / 1000
        return True

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
