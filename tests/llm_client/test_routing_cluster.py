"""Routing against real simulator processes over HTTP: churn, restart detection, degraded replicas.

Each test starts its own simulator processes (``python -m serving.simulator --port 0``) at a small time
scale, so a request lasts a fraction of a second, and stops them at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from llm_client import ClientConfig, LLMClient
from llm_client.degradation import DegradationDetector, DegradationSettings
from llm_client.hooks import Attempt, ClientHooks
from llm_client.routing.base import RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from prompt_assembly.tokens import count_tokens, messages_text
from serving.simulator.launch import SimulatorFleet
from tests.helpers import viewed_prompt


class SimCluster(SimulatorFleet):
    """The one simulator launcher, started inside a test (``start``); ``kill`` one to simulate a crash,
    ``admin`` calls a replica's test-only routes."""

    def __init__(self) -> None:
        super().__init__(0)

    async def start(self, n: int, *args: str) -> None:
        self.count, self.args = n, args
        await self.__aenter__()

    async def admin(self, i: int, path: str, body: dict[str, float] | None = None) -> dict[str, object]:
        async with aiohttp.ClientSession() as session:
            if body is None and path.endswith("stats"):
                async with session.get(self.urls[i] + path) as response:
                    return dict(await response.json())
            async with session.post(self.urls[i] + path, json=body or {}) as response:
                assert response.status == 200, await response.text()
                return dict(await response.json())


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    sims = SimCluster()
    try:
        yield sims
    finally:
        await sims.stop()


def config(urls: list[str], policy: str = "prefix_aware") -> ClientConfig:
    return ClientConfig.model_validate(
        {
            "endpoints": urls,
            "policy": policy,
            "max_in_flight": 64,
            "timeouts": {"connect_s": 0.5, "attempt_s": 10, "deadline_s": 20},
            "retry": {"max_attempts": 3, "backoff_base_s": 0.01, "budget_min_tokens": 50},
            "health": {"interval_s": 0.2},
        }
    )


def prompt(shopper: str, events: int) -> list[dict[str, str]]:
    return viewed_prompt(shopper, events, item="spooky item", category="Decor > Indoor")


async def test_replica_killed_mid_run_loses_no_request_and_is_forgotten(cluster: SimCluster) -> None:
    await cluster.start(4, "--time-scale", "0.01")
    policy = PrefixAwarePolicy()
    async with LLMClient(config(cluster.urls), policy) as client:
        await client.wait_until_healthy()
        victim = client.endpoints[1]
        done: list[str] = []

        async def shopper(i: int) -> None:
            for step in range(6):
                completion = await client.chat(
                    prompt(f"s{i}", 30 + 5 * step), routing_key=f"s{i}", max_tokens=60
                )
                done.append(completion.endpoint)

        tasks = [asyncio.create_task(shopper(i)) for i in range(24)]
        while len(done) < 40:
            await asyncio.sleep(0.01)
        assert victim.outstanding > 0, "the kill should land while requests are in flight"
        cluster.kill(1)
        results = await asyncio.gather(*tasks, return_exceptions=True)

        assert [r for r in results if r is not None] == []  # zero lost requests
        assert len(done) == 24 * 6
        assert not victim.healthy and victim.ejections >= 1
        assert len(policy.index(victim)) == 0  # forgotten
        after_kill = done[-60:]
        assert victim.name not in after_kill


async def test_cache_reset_is_detected_as_a_restart(cluster: SimCluster) -> None:
    await cluster.start(3, "--time-scale", "0.005")
    policy = PrefixAwarePolicy()
    async with LLMClient(config(cluster.urls), policy) as client:
        await client.wait_until_healthy()
        first = await client.chat(prompt("alice", 60), routing_key="alice", max_tokens=20)
        await client.chat(prompt("bob", 60), routing_key="bob", max_tokens=20)
        second = await client.chat(prompt("alice", 62), routing_key="alice", max_tokens=20)
        assert second.endpoint == first.endpoint
        assert second.cached_tokens > 0.8 * second.prompt_tokens
        home = next(e for e in client.endpoints if e.name == first.endpoint)

        await cluster.admin(client.endpoints.index(home), "/admin/reset_cache")
        third = await client.chat(prompt("alice", 64), routing_key="alice", max_tokens=20)
        assert third.endpoint == home.name and third.cached_tokens == 0
        assert home.restarts_detected == 1 and policy.stats.restarts_detected == 1
        # only this shopper's newest prompt is believed held there now
        assert policy.cached_tokens(client_route(client, "alice", 66), home) > 0
        assert sum(e.restarts_detected for e in client.endpoints) == 1


def client_route(client: LLMClient, shopper: str, events: int) -> RouteRequest:
    text = messages_text(prompt(shopper, events))
    return RouteRequest(shopper, text, count_tokens(text), 20)


async def test_slow_replica_is_drained_and_the_rest_keep_serving(cluster: SimCluster) -> None:
    # time scale 0.05: simulated GPU time, not HTTP overhead, dominates each request's latency
    await cluster.start(4, "--time-scale", "0.05")
    # 8x: far over the 3x latency factor, so the HTTP overhead a busy machine adds to every replica
    # alike cannot hide it (at 5x it failed 2 runs of 12 on this 2-core machine)
    await cluster.admin(2, "/admin/config", {"slowdown": 8.0})
    detector = DegradationDetector(DegradationSettings.model_validate({"min_samples": 4, "cooldown_s": 120}))
    async with LLMClient(config(cluster.urls, "round_robin"), degradation=detector) as client:
        await client.wait_until_healthy()
        slow = client.endpoints[2]

        async def wave(first: int, step: int) -> None:
            await asyncio.gather(
                *(
                    client.chat(prompt(f"d{i}", 20 + step), routing_key=f"d{i}", max_tokens=40)
                    for i in range(first, first + 16)
                )
            )

        for step in range(10):  # drained within at most 160 requests (about 40 on the slow replica)
            await wave(0, step)
            if slow.drained:
                break
        assert slow.drained and not any(e.drained for e in client.endpoints if e is not slow)
        assert detector.drains == 1 and slow.extra["drains"] == 1
        assert detector.changes[0].endpoint == slow.name and "latency" in detector.changes[0].reason
        served_when_drained = slow.served
        for step in range(3):
            await wave(16, step)
        assert slow.served == served_when_drained  # no new traffic while drained
        assert all(e.served > 0 for e in client.endpoints)


async def test_hooks_report_every_attempt_without_patching_the_client(cluster: SimCluster) -> None:
    """A replica answering 503: its attempt is reported failed, the retry on the other one finished."""
    await cluster.start(2, "--time-scale", "0.005")
    await cluster.admin(0, "/admin/config", {"error_rate": 1.0})
    seen: list[tuple[str, str, int]] = []
    hooks = ClientHooks()
    hooks.attempt_started.append(lambda a: seen.append(("started", a.endpoint, a.number)))
    hooks.attempt_failed.append(lambda a, exc: seen.append((type(exc).__name__, a.endpoint, a.number)))
    hooks.attempt_finished.append(lambda a, c: seen.append(("finished", c.endpoint, c.attempts)))

    def broken(attempt: Attempt) -> None:
        raise RuntimeError("a broken hook is logged, never fails the request")

    hooks.attempt_started.append(broken)
    async with LLMClient(config(cluster.urls, "round_robin"), hooks=hooks) as client:
        await client.wait_until_healthy()
        bad, good = (e.name for e in client.endpoints)
        completion = await client.chat(prompt("h", 10), routing_key="h", max_tokens=5)
    assert completion.endpoint == good and completion.attempts == 2
    assert seen == [
        ("started", bad, 1),
        ("EndpointUnavailable", bad, 1),
        ("started", good, 2),
        ("finished", good, 2),
    ]
