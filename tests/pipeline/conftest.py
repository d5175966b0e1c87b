"""Fixtures the pipeline tests share."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from sinks.config import SinkSettings


@pytest.fixture
async def sinks() -> AsyncIterator[SinkSettings]:
    """Sink settings of this test alone: the local Redis under a prefix of its own, removed after."""
    settings = SinkSettings(redis_key_prefix=f"test-ledger-{uuid.uuid4().hex[:10]}:")
    yield settings
    client: aioredis.Redis = settings.redis_client()
    keys = [key async for key in client.scan_iter(match=f"{settings.redis_key_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
