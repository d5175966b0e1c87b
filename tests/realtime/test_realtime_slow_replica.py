"""A replica slower than the callers' deadlines, with the service's defaults, against real simulator
replicas over HTTP: its calls are cut at the deadline and answered within the latency pool's grace
(``llm_pool.CUT_GRACE_S``). Those answers are latency samples (``llm_client.cut_calls``, ``on_late``), so
the degradation detector drains the replica, and ``/metrics`` shows it drained. Before, a call cut at
its deadline taught nothing: the replica was never judged, and a third of the answers stayed degraded
(``deadline``) for as long as it stayed slow."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from serving.simulator.testing import running_simulator
from tests.conftest import Isolated
from tests.realtime.service_kit import realtime_service

CANDIDATES = [{"product_id": f"p{i}", "title": f"Costume {i}"} for i in range(5)]


async def test_a_replica_slower_than_the_deadline_is_drained_and_shown_drained(isolated: Isolated) -> None:
    async with (
        running_simulator(time_scale=0.01) as fast_a,
        running_simulator(time_scale=0.01) as fast_b,
        running_simulator(time_scale=0.01, network_rtt_ms=300) as slow,
        realtime_service(isolated, [fast_a.url, fast_b.url, slow.url]) as client,
    ):
        # The model's time on each kind of replica, uncut: three calls at once, one per replica.
        uncut = await asyncio.gather(*(match(client, f"warm-{i}", deadline_ms=5000) for i in range(3)))
        times = sorted(body["llm_ms"] for body in uncut)
        assert times[2] > 3.5 * times[0], times
        deadline_ms = int((times[0] * times[2]) ** 0.5) + 20  # the fast ones answer in time, the slow not
        state = f'realtime_llm_endpoint_state{{endpoint="{name(slow.url)}",state="drained"}} 1.0'
        degraded = 0
        for batch in range(60):
            answers = await asyncio.gather(
                *(match(client, f"s{batch}-{i}", deadline_ms) for i in range(3)), return_exceptions=True
            )
            degraded += sum(1 for a in answers if isinstance(a, dict) and a["degraded_reason"] == "deadline")
            if state in await (await client.get("/metrics")).text():
                break
        metrics = await (await client.get("/metrics")).text()
        assert degraded > 0, "no model call was cut: the slow replica is not slower than the deadline"
        assert state in metrics, [
            line for line in metrics.splitlines() if "endpoint_state" in line or "cut" in line
        ]
        for fast in (fast_a, fast_b):
            assert (
                f'realtime_llm_endpoint_state{{endpoint="{name(fast.url)}",state="routable"}} 1.0' in metrics
            )
        # Drained, the slow replica gets no new call: answers come from the model again.
        await asyncio.sleep(0.3)  # the cut calls still reading on end
        after = await asyncio.gather(*(match(client, f"after-{i}", deadline_ms) for i in range(6)))
        assert [a["degraded"] for a in after] == [False] * 6, after


async def match(client: TestClient[Any, Any], shopper_id: str, deadline_ms: int) -> dict[str, Any]:
    body = {"shopper_id": shopper_id, "query": "", "candidates": CANDIDATES, "deadline_ms": deadline_ms}
    response = await client.post("/v1/match", json=body)
    assert response.status == 200, await response.text()
    answer: dict[str, Any] = await response.json()
    return answer


def name(url: str) -> str:
    """A replica's name on ``/metrics`` (``Endpoint.name``): its address without the scheme."""
    return url.removeprefix("http://")
