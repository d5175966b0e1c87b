"""Product signals in Redis, for the real-time matcher to read next to shopper signals.

Key ``{prefix}product:{product_id}`` is a hash: segments and occasions (JSON lists), style,
price_tier, summary, title, custom_id, job_id, model, updated_at. A redone shard writes the same
values again (an overwrite, never a second copy); the newest job to finish a product wins.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from sinks.keys import RedisKeys


def product_signal_fields(row: dict[str, Any], job_id: str) -> dict[str, str]:
    """Hash fields from one output row (``records.output_row``)."""
    body = row["response"]["body"]
    u = body["understanding"]
    return {
        "segments": orjson.dumps(u["segments"]).decode(),
        "occasions": orjson.dumps(u["occasions"]).decode(),
        "style": u["style"],
        "price_tier": u["price_tier"],
        "summary": u["summary"],
        "title": body.get("title", ""),
        "custom_id": row["custom_id"],
        "job_id": job_id,
        "model": body["model"],
        "updated_at": repr(time.time()),
    }


class ProductSignalWriter:
    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.written = 0

    async def write(self, job_id: str, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        pipe = self.redis.pipeline(transaction=False)
        for row in rows:
            key = RedisKeys(self.prefix).product(row["response"]["body"]["product_id"])
            pipe.hset(key, mapping=product_signal_fields(row, job_id))
            pipe.expire(key, self.ttl_s)
        await pipe.execute()
        self.written += len(rows)
