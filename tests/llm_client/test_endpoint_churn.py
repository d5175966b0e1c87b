"""A replica dropped with a call still running on it is not brought back by that call, against
simulator replicas over HTTP.

``set_endpoints`` forgets a dropped replica (its cache picture, latency samples, answer window), but a
call still running on it went on to teach the fleet when it ended, which re-created what was forgotten.
Under address churn (pod IPs) such entries piled up, and capacity shifting, which moves the same
addresses between pools, found the old replica's samples again when the address came back: it was not
"judged afresh" as ``DegradationDetector.forget`` says.
"""

from __future__ import annotations

import asyncio

from llm_client import ClientConfig, LLMClient
from serving.simulator.testing import running_simulator

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_call_finishing_on_a_dropped_replica_teaches_the_fleet_nothing() -> None:
    async with running_simulator(time_scale=0.0) as a, running_simulator(time_scale=0.05) as b:
        config = ClientConfig(endpoints=[a.url, b.url], model="m", policy="round_robin")
        async with LLMClient(config) as client:
            await client.wait_until_healthy()
            calls = [
                asyncio.create_task(client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=200))
                for i in range(2)
            ]  # round robin: one on each; the one on b takes a few hundred ms
            await asyncio.sleep(0.05)
            dropped = next(e for e in client.endpoints if e.url == b.url)
            assert dropped.outstanding == 1, "b's call is running"
            client.set_endpoints([a.url])
            answers = await asyncio.gather(*calls)
            assert {answer.endpoint for answer in answers} == {client.endpoints[0].name, dropped.name}
            client.set_endpoints([a.url, b.url])  # the address comes back: a new replica to judge
            back = next(e for e in client.endpoints if e.url == b.url)
            assert back is not dropped
            assert client.degradation.signals(back).samples == 0, "judged afresh"
