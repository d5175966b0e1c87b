"""What a cancelled call teaches the degradation detector, against simulator replicas over real HTTP.

A call cut by its own deadline while at a replica is an error for the detector
(``tests/realtime/test_realtime_slow_replica.py``: a replica slower than the deadline is drained).
A caller's own cancel (the stream engines superseding a prompt, a caller gone) says nothing about the
replica, however slow: here calls to a slow replica are cancelled in flight, many more than the
detector's ``min_samples``, and nothing is learned or drained.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, Timeouts
from serving.simulator.testing import running_simulator
from tests.helpers import until

MESSAGES = [
    {"role": "system", "content": "You describe shoppers. " * 40},
    {"role": "user", "content": "viewed hats"},
]
WAVE = 12
"""Calls at once: least outstanding requests spreads them evenly, 4 to each of the 3 replicas."""


async def test_calls_their_caller_cancels_in_flight_drain_nothing() -> None:
    async with AsyncExitStack() as stack:
        urls = [
            (await stack.enter_async_context(running_simulator(time_scale=0.01, slowdown=s))).url
            for s in (1.0, 100.0, 1.0)  # the slow one answers in about 1.5 s
        ]
        config = ClientConfig(
            endpoints=urls,
            policy="least_outstanding",
            timeouts=Timeouts(connect_s=1, attempt_s=30, deadline_s=30),
            health=HealthSettings(interval_s=0.05),
        )
        client = await stack.enter_async_context(LLMClient(config))
        await client.wait_until_healthy()
        slow = client.endpoints[1]
        cancelled = 0
        for step in range(8):
            calls = [
                asyncio.create_task(client.chat(MESSAGES, routing_key=f"s{step}-{i}", max_tokens=64))
                for i in range(WAVE)
            ]
            # The healthy replicas answer theirs; the slow one's are still in flight, and cancelled.
            await until(lambda calls=calls: sum(c.done() for c in calls) == WAVE - slow.outstanding, 5.0)
            assert slow.outstanding == WAVE // 3
            for call in calls:
                call.cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
            cancelled += sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert cancelled == 8 * WAVE // 3  # twice min_samples: it would have been drained
        assert client.degradation.signals(slow).samples == 0
        assert not any(e.drained for e in client.endpoints) and client.degradation.drains == 0
        assert slow.healthy and slow.failed == 0
