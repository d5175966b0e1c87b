"""How long an engine waits for a store that is down, one policy for every store and both engines.

A store that is down (Redis restarting, S3 unreachable, a broker away) is waited for, with capped
exponential backoff and jitter, for up to ``max_wait_s``; only then does the write fail, and the engine
stops without committing past it (the runner exits, Flink restarts the job), so a replay from the last
commit stores it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class SinkRetry(BaseModel):
    """How long a sink write waits for a store that is down before the engine gives up."""

    max_wait_s: float = Field(
        120.0, gt=0, description="a store down longer than this stops the engine (a restart replays)"
    )
    initial_backoff_s: float = Field(0.05, gt=0)
    max_backoff_s: float = Field(2.0, gt=0, description="polls a recovering store at least this often")


async def with_sink_retry(
    write: Callable[[], Awaitable[T]],
    policy: SinkRetry,
    *,
    what: str,
    on_retry: Callable[[str, BaseException], None] | None = None,
    retry_if: Callable[[BaseException], bool] = lambda _: True,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``write()``, retried on an error ``retry_if`` accepts (any, by default) until it succeeds or
    ``policy.max_wait_s`` has passed (then the last error is raised). Writes must be idempotent: every
    sink here is."""
    started = clock()
    backoff = policy.initial_backoff_s
    while True:
        try:
            return await write()
        except Exception as exc:
            if not retry_if(exc) or clock() - started + backoff > policy.max_wait_s:
                raise
            if on_retry is not None:
                on_retry(what, exc)
            await asyncio.sleep(random.uniform(backoff / 2, backoff))
            backoff = min(policy.max_backoff_s, backoff * 2)
