"""Per-shopper signals in Redis (ElastiCache in production), for ad servers to read.

Key ``{prefix}signals:{shopper_id}`` is a hash: summary, interests (JSON), occasion, style,
price_sensitivity, understanding (JSON), model, replica, prompt/cached/completion tokens, seq (the
version), request_id, last_event_ts, updated_at. A Lua script writes it only when the incoming ``seq``
is greater than the stored one, atomically, so replays, duplicates and out-of-order completions never
regress a value. Errors are not written here (a stale good answer beats no answer); they are counted
in ``{prefix}signal_errors:{shopper_id}`` (request_id -> error type) and go to S3 with every other result.
Both hashes expire after ``signal_ttl_s`` without a write; each script sets its key's expiry in the same
call as the write, so no hash ever exists without one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from prompt_assembly.records import EnrichmentResult, ShopperInsight
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

_WRITE_IF_NEWER = """
local current = redis.call('HGET', KEYS[1], 'seq')
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

_RECORD_ERROR = """
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
"""One error record (request_id -> error type) and the hash's expiry, atomically: a replayed error is
stored once, and a shopper who goes quiet leaves nothing behind."""


def signal_fields(insight: ShopperInsight) -> dict[str, str]:
    u = insight.understanding
    return {
        "seq": str(insight.seq),
        "request_id": insight.request_id,
        "summary": u.summary,
        "interests": orjson.dumps(u.interests).decode(),
        "occasion": u.occasion or "",
        "style": u.style,
        "price_sensitivity": u.price_sensitivity,
        "understanding": u.model_dump_json(),
        "reason": insight.reason,
        "model": insight.model,
        "replica": insight.replica,
        "prompt_tokens": str(insight.usage.prompt_tokens),
        "cached_tokens": str(insight.usage.cached_tokens),
        "completion_tokens": str(insight.usage.completion_tokens),
        "event_count": str(insight.event_count),
        "last_event_ts": repr(insight.last_event_ts),
        "updated_at": repr(time.time()),
    }


class RedisSignalSink:
    name = "redis"

    def __init__(self, settings: SinkSettings, client: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.keys = RedisKeys(settings.redis_key_prefix)
        self.redis = client or settings.redis_client()
        self._owns_client = client is None
        self._script = self.redis.register_script(_WRITE_IF_NEWER)
        self._record_error = self.redis.register_script(_RECORD_ERROR)
        self.written = 0
        self.stale_skipped = 0
        self.errors_counted = 0

    def key(self, shopper_id: str) -> str:
        return self.keys.signals(shopper_id)

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        if not results:
            return
        pipe = self.redis.pipeline(transaction=False)
        for result in results:
            if isinstance(result, ShopperInsight):
                args: list[Any] = [result.seq, self.settings.signal_ttl_s]
                for field, value in signal_fields(result).items():
                    args += [field, value]
                await self._script(keys=[self.key(result.shopper_id)], args=args, client=pipe)
            else:
                await self._record_error(
                    keys=[self.keys.signal_errors(result.shopper_id)],
                    args=[self.settings.signal_ttl_s, result.request_id, result.error_type],
                    client=pipe,
                )
        replies = await pipe.execute()
        applied = 0
        for result, reply in zip(results, replies, strict=True):
            if isinstance(result, ShopperInsight):
                if reply == 1:
                    applied += 1
                else:
                    self.stale_skipped += 1
            else:
                self.errors_counted += 1
        self.written += applied

    async def read(self, shopper_id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.key(shopper_id))  # type: ignore[misc]
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def open(self) -> None:
        return None

    def due(self) -> bool:
        return False  # each write is durable when it returns

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        if self._owns_client:
            await self.redis.aclose()
