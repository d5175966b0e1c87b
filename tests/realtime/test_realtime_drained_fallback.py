"""The real-time service serves through a drained replica when it is the only one left, as its LLM client
does (``Fleet.servable``), against simulator replicas over HTTP.

The service counted only routable replicas: with every routable one gone and a drained one still
answering, each match answered degraded ``llm_unavailable`` (and its concurrency limit was 0) while the
client itself would have served the call.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from aiohttp.test_utils import TestClient, TestServer

from realtime.config import RealtimeSettings
from realtime.service import SERVICE_KEY, create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from tests.conftest import Isolated

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_drained_replica_serves_matches_when_every_routable_one_is_gone(isolated: Isolated) -> None:
    async with running_simulator(time_scale=0.01, slowdown=50.0) as slow, AsyncExitStack() as others:
        gone = [await others.enter_async_context(running_simulator(time_scale=0.01)) for _ in range(2)]
        # Round robin, so the slow replica gets its share of calls and the detector judges it.
        llm = realtime_client_config([slow.url, *(r.url for r in gone)], "m", policy="round_robin")
        app = create_app(RealtimeSettings(), llm_config=llm, sinks=isolated.sinks())
        async with TestClient(TestServer(app)) as client:
            service = app[SERVICE_KEY]
            await service.llm.wait_until_healthy()
            drained = next(e for e in service.llm.endpoints if e.url == slow.url)
            for i in range(120):  # the default min_samples (20) on each replica, and more
                await service.llm.chat(MESSAGES, routing_key=f"s{i}", max_tokens=4)
                if drained.drained:
                    break
            assert drained.drained, "the detector drains the slow replica"
            await others.aclose()  # both others crash: connections refused, each ejected at its call
            body = {"shopper_id": "s1", "candidates": ["a", "b", "c"], "deadline_ms": 5000}
            for _ in range(5):
                if not any(e.routable for e in service.llm.endpoints):
                    break
                await client.post("/v1/match", json=body)
            assert not any(e.routable for e in service.llm.endpoints)

            response = await client.post("/v1/match", json=body)
            answer = await response.json()
            assert response.status == 200, answer
            assert answer["degraded_reason"] is None and answer["llm_ms"] is not None, answer
            assert drained.drained, "still drained: served only as the last resort"
