"""Shopper sessions in Redis, for the embedded runner (the Flink job keeps them in keyed state).

Layout per shopper: ``{p}session:{id}:h`` (JSON header) and ``{p}session:{id}:log`` (a list of
entries, append-only except after a trim, when it is rewritten). Pending triggers are mirrored in
``{p}timers:{partition}`` (sorted set: shopper -> trigger due time in event seconds, plus the wall
deadline in the header) so that a restarted runner re-arms them. Deltas are applied in epoch order, in
one pipeline, only after the results of those epochs are durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from prompt_assembly.session import SessionChanges, ShopperSession
from sinks.keys import RedisKeys


@dataclass(frozen=True, slots=True)
class SessionDelta:
    shopper_id: str
    partition: int
    changes: SessionChanges


class RedisSessionStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int = 7 * 24 * 3600) -> None:
        self.redis = redis
        self.keys = RedisKeys(prefix)
        self.ttl_s = ttl_s

    def _h(self, shopper_id: str) -> str:
        return self.keys.session_header(shopper_id)

    def _log(self, shopper_id: str) -> str:
        return self.keys.session_log(shopper_id)

    def _timers(self, partition: int) -> str:
        return self.keys.timers(partition)

    async def load_many(self, shopper_ids: Sequence[str]) -> dict[str, ShopperSession]:
        """Sessions that exist in Redis (missing ids are simply absent from the result)."""
        if not shopper_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for shopper_id in shopper_ids:
            pipe.get(self._h(shopper_id))
            pipe.lrange(self._log(shopper_id), 0, -1)
        replies = await pipe.execute()
        sessions: dict[str, ShopperSession] = {}
        for i, shopper_id in enumerate(shopper_ids):
            header, entries = replies[2 * i], replies[2 * i + 1]
            if header is not None:
                sessions[shopper_id] = ShopperSession.restore(orjson.loads(header), entries)
        return sessions

    async def save(self, deltas: Iterable[SessionDelta], wall_deadlines: dict[str, float]) -> int:
        """Apply deltas in order (one pipeline, one round trip). ``wall_deadlines`` gives the timer
        deadline of each shopper with a pending trigger after these deltas."""
        pipe = self.redis.pipeline(transaction=True)
        count = 0
        for delta in deltas:
            count += 1
            sid, changes = delta.shopper_id, delta.changes
            log_key = self._log(sid)
            if changes.rewrite is not None:
                pipe.delete(log_key)
                if changes.rewrite:
                    pipe.rpush(log_key, *(e.to_json() for e in changes.rewrite))
            elif changes.appended:
                pipe.rpush(log_key, *(e.to_json() for e in changes.appended))
            pipe.set(self._h(sid), orjson.dumps(changes.header), ex=self.ttl_s)
            pipe.expire(log_key, self.ttl_s)
            if changes.header.get("pending") is not None and sid in wall_deadlines:
                pipe.zadd(self._timers(delta.partition), {sid: wall_deadlines[sid]})
            else:
                pipe.zrem(self._timers(delta.partition), sid)
        if count:
            await pipe.execute()
        return count

    async def timers(self, partition: int) -> list[tuple[str, float]]:
        """(shopper, wall deadline) of the pending triggers of ``partition``."""
        raw = await self.redis.zrange(self._timers(partition), 0, -1, withscores=True)
        return [(member.decode(), score) for member, score in raw]
