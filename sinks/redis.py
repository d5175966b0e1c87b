"""Per-shopper signals in Redis (ElastiCache in production), for ad servers to read.

Key ``{prefix}signals:{shopper_id}`` is a hash: summary, interests (JSON), occasion, style,
price_sensitivity, understanding (JSON), model, replica, prompt/cached/completion tokens, session_epoch
and seq (the version), resets, write_id, request_id, last_event_ts, updated_at (``signal_fields``; the
contract is docs/contracts.md). A Lua script writes it only when the incoming version
``(session_epoch, seq)`` is greater than the stored one, atomically, so replays, duplicates and
out-of-order completions never regress a value, while the answers of a session started after its
state was lost (a newer epoch) replace the lost session's at once; ``resets`` counts how often that
happened to the shopper.
Superseded prompts (``Superseded``: latest wins, or stale) write nothing here: they are counted in
``superseded_skipped`` only, so the shopper's signal stays the newest answer that was computed.
Errors are not written here (a stale good answer beats no answer); they are counted
in ``{prefix}signal_errors:{shopper_id}`` (request_id -> error type), which keeps those of the
``signal_errors_max`` newest versions, and go to S3 with every other result.
Both hashes expire after ``signal_ttl_s`` without a write; each script sets its key's expiry in the same
call as the write, so no hash ever exists without one.

A write whose reply was lost (a timeout, a dropped connection) and is tried again finds its own version
stored. Each write of an answer carries a write id, stored with it (``write_id``), and a try after one
that got no reply sends the same id: the script answers it as already written (with whether that write
was a reset), so the retry counts once as written, and its reset once, never as stale. A duplicate
from elsewhere (a replay, a second engine) has another id and stays stale. A retry that finds its
own write already replaced by a newer version cannot tell, and counts as stale.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from prompt_assembly.records import EnrichmentResult, ShopperInsight, Superseded
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

STALE, WRITTEN, WRITTEN_RESET, WRITTEN_BEFORE, WRITTEN_BEFORE_RESET = range(5)
"""``_WRITE_IF_NEWER``'s replies: not newer; written; written, a session reset; and the same two when
an earlier try of the same write (its reply lost) had written it already."""

_WRITE_IF_NEWER = """
local stored = redis.call('HMGET', KEYS[1], 'session_epoch', 'seq', 'resets', 'write_id')
local epoch, seq = tonumber(ARGV[1]), tonumber(ARGV[2])
local reset = 0
if stored[2] then
  local stored_epoch, stored_seq = tonumber(stored[1]) or 0, tonumber(stored[2])
  if stored_epoch > epoch or (stored_epoch == epoch and stored_seq >= seq) then
    if stored_epoch == epoch and stored_seq == seq then
      if stored[4] == ARGV[4] .. ':0' then return 3 end
      if stored[4] == ARGV[4] .. ':1' then return 4 end
    end
    return 0
  end
  if stored_epoch < epoch then
    reset = 1
  end
end
local resets = (tonumber(stored[3]) or 0) + reset
redis.call('HSET', KEYS[1], 'resets', resets, 'write_id', ARGV[4] .. ':' .. reset, unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1 + reset
"""
"""Write the answer only when its version ``(session_epoch, seq)`` is newer than the stored one; a newer
epoch over an older one is a session reset: counted in the hash (``resets``). ARGV: epoch, seq, TTL, the
write id, then the fields. ``write_id`` stores the id and whether the write was a reset (``id:0`` or
``id:1``), so a try of the same write finds its version already stored under its own id and is told so
(``WRITTEN_BEFORE``, ``WRITTEN_BEFORE_RESET``) instead of ``STALE``."""

_RECORD_ERROR = """
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
local excess = redis.call('HLEN', KEYS[1]) - tonumber(ARGV[4])
if excess <= 0 then return 0 end
local held = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  local epoch, seq = string.match(id, ':(%-?%d+):(%d+)$')
  held[#held + 1] = {tonumber(epoch or '-1'), tonumber(seq or '-1'), id}
end
table.sort(held, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a[3] < b[3]
end)
for i = 1, excess do redis.call('HDEL', KEYS[1], held[i][3]) end
return excess
"""
"""One error record (request_id -> error type), the hash's expiry and its cap, atomically: at most
ARGV[4] records stay, those of the newest versions, read from each ``request_id``
(``shopper_id:session_epoch:seq``; an id not of that form counts as older than any). Ordered by version,
not by arrival, the kept set does not depend on the order errors come in: a replayed old error is
stored and dropped in the same call. Answers how many records it dropped."""


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
        self._unanswered: dict[str, str] = {}
        """``request_id`` -> write id of each answer whose write got no reply (the call raised), for its
        retry to send again. Emptied as those writes are answered; only a write the engine gave up on
        (it stops then) leaves its ids behind."""
        self.written = 0
        self.stale_skipped = 0
        self.session_resets = 0
        """Answers of a new session that replaced an older session's (its state was lost or expired
        while the shopper's signal lived): the counter an engine exposes as ``session_resets``."""
        self.lost_replies = 0
        """Writes whose reply was lost but which had landed, as their retry found (counted in ``written``)."""
        self.errors_counted = 0
        self.errors_dropped = 0
        """Error records dropped from a shopper's errors hash to keep it at ``signal_errors_max``."""
        self.superseded_skipped = 0

    def key(self, shopper_id: str) -> str:
        return self.keys.signals(shopper_id)

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        stored = [r for r in results if not isinstance(r, Superseded)]
        self.superseded_skipped += len(results) - len(stored)
        if not stored:
            return
        write_ids = iter(self._write_ids([r for r in stored if isinstance(r, ShopperInsight)]))
        pipe = self.redis.pipeline(transaction=False)
        for result in stored:
            if isinstance(result, ShopperInsight):
                args: list[Any] = [
                    result.session_epoch,
                    result.seq,
                    self.settings.signal_ttl_s,
                    next(write_ids),
                ]
                for field, value in signal_fields(result).items():
                    args += [field, value]
                await self._script(keys=[self.key(result.shopper_id)], args=args, client=pipe)
            else:
                await self._record_error(
                    keys=[self.keys.signal_errors(result.shopper_id)],
                    args=[
                        self.settings.signal_ttl_s,
                        result.request_id,
                        result.error_type,
                        self.settings.signal_errors_max,
                    ],
                    client=pipe,
                )
        replies = await pipe.execute()
        for result in stored:
            self._unanswered.pop(result.request_id, None)
        applied = 0
        for result, reply in zip(stored, replies, strict=True):
            if isinstance(result, ShopperInsight):
                if reply == STALE:
                    self.stale_skipped += 1
                else:
                    applied += 1
                    self.session_resets += reply in (WRITTEN_RESET, WRITTEN_BEFORE_RESET)
                    self.lost_replies += reply >= WRITTEN_BEFORE
            else:
                self.errors_counted += 1
                self.errors_dropped += reply
        self.written += applied

    def _write_ids(self, insights: Sequence[ShopperInsight]) -> list[str]:
        """A write id per answer, in order, noted as unanswered until the call that sends it gets its
        reply: the id of an earlier try still waiting for one, else a new one. A second copy of an
        answer in one batch gets a new id of its own, so it can never pass for the first one's retry."""
        ids: list[str] = []
        sent: set[str] = set()
        for insight in insights:
            if insight.request_id in sent:
                ids.append(secrets.token_hex(8))
            else:
                sent.add(insight.request_id)
                ids.append(self._unanswered.setdefault(insight.request_id, secrets.token_hex(8)))
        return ids

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
