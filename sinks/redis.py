"""Per-shopper signals in Redis (ElastiCache in production), for ad servers to read.

Key ``{prefix}signals:{shopper_id}`` is a hash: summary, interests (JSON), occasion, style,
price_sensitivity, understanding (JSON), model, replica, prompt/cached/completion tokens, session_epoch
and seq (the version), resets, request_id, last_event_ts, updated_at (``signal_fields``; the contract
is docs/contracts.md). A Lua script writes it only when the incoming version ``(session_epoch, seq)`` is
greater than the stored one, atomically, so replays, duplicates and out-of-order completions never
regress a value, while the answers of a session started after its state was lost (a newer epoch)
replace the lost session's at once; ``resets`` counts how often that happened to the shopper.
Superseded prompts (``Superseded``: latest wins, or stale) write nothing here: they are counted in
``superseded_skipped`` only, so the shopper's signal stays the newest answer that was computed.
Errors are not written here (a stale good answer beats no answer); they are counted
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

from prompt_assembly.records import EnrichmentResult, ShopperInsight, Superseded
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

_WRITE_IF_NEWER = """
local stored = redis.call('HMGET', KEYS[1], 'session_epoch', 'seq', 'resets')
local epoch, seq = tonumber(ARGV[1]), tonumber(ARGV[2])
local reset = 0
if stored[2] then
  local stored_epoch, stored_seq = tonumber(stored[1]) or 0, tonumber(stored[2])
  if stored_epoch > epoch or (stored_epoch == epoch and stored_seq >= seq) then
    return 0
  end
  if stored_epoch < epoch then
    reset = 1
  end
end
local resets = (tonumber(stored[3]) or 0) + reset
redis.call('HSET', KEYS[1], 'resets', resets, unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1 + reset
"""
"""Write the answer only when its version ``(session_epoch, seq)`` is newer than the stored one; a newer
epoch over an older one is a session reset: counted in the hash (``resets``) and answered 2."""

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
        "session_epoch": str(insight.session_epoch),
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
        self.session_resets = 0
        """Answers of a new session that replaced an older session's (its state was lost or expired
        while the shopper's signal lived): the counter an engine exposes as ``session_resets``."""
        self.errors_counted = 0
        self.superseded_skipped = 0

    def key(self, shopper_id: str) -> str:
        return self.keys.signals(shopper_id)

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        stored = [r for r in results if not isinstance(r, Superseded)]
        self.superseded_skipped += len(results) - len(stored)
        if not stored:
            return
        pipe = self.redis.pipeline(transaction=False)
        for result in stored:
            if isinstance(result, ShopperInsight):
                args: list[Any] = [result.session_epoch, result.seq, self.settings.signal_ttl_s]
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
        for result, reply in zip(stored, replies, strict=True):
            if isinstance(result, ShopperInsight):
                if reply >= 1:
                    applied += 1
                    self.session_resets += reply == 2
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
