"""Never pay twice for one prompt: each answer is recorded in Redis the moment it arrives, by the
prompt's ``request_id`` (``shopper:session_epoch:seq``, the same on every replay of the same events).

An engine replays prompts after a crash, a restart or a rebalance: everything after its last durable
point. Without a record, every prompt whose answer came back after that point is sent to the model
again. With it, ``pipeline.enrichment.Enricher`` reads the record first and returns the recorded answer
(``ShopperInsight.replayed``) without a call. The record is written before the engine's sinks see the
answer, so it never trails the engine's checkpoint.

Only insights are recorded: an error or a superseded prompt cost little or nothing, and asking again
on replay is what a person would want. Each key expires after ``SinkSettings.answer_ttl_s``, so the
ledger is bounded by the prompt rate times that TTL. Redis being away never stops the stream: a failed
read asks the model (the pre-ledger behaviour), a failed write loses only the saving; both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from prompt_assembly.records import ShopperInsight
from sinks.config import SinkSettings
from sinks.keys import RedisKeys


@dataclass(slots=True)
class LedgerCounts:
    recorded: int = 0
    found: int = 0
    read_failures: int = 0
    write_failures: int = 0


class AnswerLedger:
    """The answers already paid for, by ``request_id``; shared by every process of a deployment."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.counts = LedgerCounts()

    @classmethod
    def from_settings(cls, settings: SinkSettings, redis: aioredis.Redis | None = None) -> AnswerLedger:
        """The ledger at the sinks' Redis and key prefix (``redis``: an engine's shared client)."""
        client = redis if redis is not None else settings.redis_client()
        return cls(client, RedisKeys(settings.redis_key_prefix), settings.answer_ttl_s)

    async def recorded(self, request_id: str) -> ShopperInsight | None:
        """The answer recorded for ``request_id``, or None (also when Redis cannot be read)."""
        try:
            raw: bytes | None = await self.redis.get(self.keys.answer(request_id))
        except RedisError:
            self.counts.read_failures += 1
            return None
        if raw is None:
            return None
        try:
            insight = ShopperInsight.model_validate_json(raw)
        except ValidationError:  # written by another version of the record: ask the model again
            self.counts.read_failures += 1
            return None
        self.counts.found += 1
        return insight

    async def record(self, insight: ShopperInsight) -> None:
        """Record ``insight`` under its ``request_id`` with the ledger's TTL (a replayed write of the
        same answer only renews it)."""
        try:
            await self.redis.set(
                self.keys.answer(insight.request_id), insight.model_dump_json(), ex=self.ttl_s
            )
        except RedisError:
            self.counts.write_failures += 1
            return
        self.counts.recorded += 1
