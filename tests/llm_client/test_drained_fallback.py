"""A drained replica is the fallback when every other one is gone, against simulator replicas over HTTP.

The degradation detector drains a slow replica only while enough others remain routable. When those
are ejected after (a restart, a crash), the drained one still answers, slowly; it stayed out for its
whole cool-down (30 s, doubling to 600 s) and every call waited for a re-admission until its deadline.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from llm_client import ClientConfig, LLMClient
from serving.simulator.testing import running_simulator

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_drained_replica_answers_when_every_routable_one_is_gone() -> None:
    async with (
        running_simulator(time_scale=0.01, slowdown=50.0) as slow,
        AsyncExitStack() as others,
    ):
        gone = [await others.enter_async_context(running_simulator(time_scale=0.01)) for _ in range(2)]
        config = ClientConfig(endpoints=[slow.url, *(r.url for r in gone)], model="m", policy="round_robin")
        async with LLMClient(config) as client:
            await client.wait_until_healthy()
            drained = next(e for e in client.endpoints if e.url == slow.url)
            for i in range(120):  # the default min_samples (20) on each replica, and more
                await client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=4)
                if drained.drained:
                    break
            assert drained.drained, "the detector drains the slow replica"
            await others.aclose()  # both others crash: connections refused, each ejected at its call
            answer = await client.chat(MESSAGES, routing_key="s-last", max_tokens=4, deadline_s=10)
            assert answer.endpoint == drained.name
            assert drained.drained, "still drained: served only as the last resort"
            assert not any(e.routable for e in client.endpoints)
