"""Why signal reads and model calls fail, in the log: against the stack's Redis and a simulator replica
over real HTTP. The service counted them (``realtime_signal_errors``, ``realtime_degraded``) and never
said why; under an outage they fail on every request, so a line each would flood the log: one line per
reason per interval, saying how many were left out since the last."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from devstack.stack import StackState
from realtime.config import RealtimeSettings
from realtime.failure_log import LOG_INTERVAL_S, ThrottledLog
from realtime.handlers import SERVICE_KEY
from realtime.service import create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from sinks.keys import RedisKeys
from tests.conftest import Isolated

REQUESTS = 20


def lines(caplog: pytest.LogCaptureFixture, reason: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "realtime.matching" and r.getMessage().split("[")[-1].startswith(reason)
    ]


async def test_a_failing_redis_and_model_are_logged_once_per_reason_not_per_request(
    stack: StackState, isolated: Isolated, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request's signal read fails (a product's bytes in Redis are not UTF-8: ``ValueError``) and
    every model call is refused (the replica answers 503, and is ejected): one line each, with the
    cause; past the interval the next line counts the ones left out."""
    caplog.set_level(logging.WARNING, logger="realtime.matching")
    settings = isolated.sinks()
    redis = aioredis.Redis.from_url(stack.redis_url)
    await redis.hset(RedisKeys(settings.redis_key_prefix).product("BAD-bytes"), "title", b"Witch \xe2\x80")
    now = [0.0]
    async with running_simulator(time_scale=0.01, error_rate=1.0) as failing:
        app = create_app(
            RealtimeSettings(),
            llm_config=realtime_client_config([failing.url], "m"),
            sinks=settings,
            redis=redis,
        )
        app[SERVICE_KEY].failures.clock = lambda: now[0]
        try:
            async with TestClient(TestServer(app)) as client:

                async def match() -> dict[str, Any]:
                    body = {"shopper_id": "s1", "query": "witch", "candidates": ["BAD-bytes", "MAK-paint"]}
                    response = await client.post("/v1/match", json=body)
                    assert response.status == 200, await response.text()
                    answer: dict[str, Any] = await response.json()
                    return answer

                for _ in range(REQUESTS):
                    answer = await match()
                    assert answer["degraded_reason"] == "llm_unavailable"
                    assert answer["signals"] == {"shopper": False, "products": 0}
                signal_lines, model_lines = lines(caplog, "signal_error"), lines(caplog, "llm_unavailable")
                now[0] += LOG_INTERVAL_S
                await match()
                metrics = await (await client.get("/metrics")).text()
        finally:
            await redis.aclose()
    assert f"realtime_signal_errors_total {REQUESTS + 1}.0" in metrics
    assert f'realtime_degraded_total{{reason="llm_unavailable"}} {REQUESTS + 1}.0' in metrics
    assert len(signal_lines) == 1 and "not valid UTF-8" in signal_lines[0], signal_lines
    assert len(model_lines) == 1 and "llm_unavailable" in model_lines[0], model_lines
    later = lines(caplog, "signal_error")[1:]
    assert len(later) == 1 and f"{REQUESTS - 1} more left out in the 10 s" in later[0], later
    assert len(lines(caplog, "llm_unavailable")) == 2
    assert not lines(caplog, "deadline") and not lines(caplog, "overloaded")


def test_throttled_log_keeps_one_line_per_reason_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.throttled")
    now = [100.0]
    log = ThrottledLog(logging.getLogger("test.throttled"), interval_s=10.0, clock=lambda: now[0])
    for i in range(5):
        log.warning("a", "failed: %d", i)
        log.warning("b", "other: %d", i)
    now[0] += 9.9
    log.warning("a", "failed: %d", 5)  # still within a's interval: left out
    now[0] += 0.1
    log.warning("a", "failed: %d", 6)
    log.warning("a", "failed: %d", 7)
    now[0] += 10.0
    log.warning("a", "failed: %d", 8)
    now[0] += 10.0
    log.warning("a", "failed: %d", 9)  # nothing left out since the last line: no count
    assert [r.getMessage() for r in caplog.records] == [
        "failed: 0 [a]",
        "other: 0 [b]",
        "failed: 6 [a; 5 more left out in the 10 s since the last line]",
        "failed: 8 [a; 1 more left out in the 10 s since the last line]",
        "failed: 9 [a]",
    ]
