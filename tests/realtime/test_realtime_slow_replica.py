"""A replica slower than the real-time service's deadline, against simulator replicas over real HTTP.

The service cuts every model call at its deadline (a few hundred ms). A replica slower than that never
completed a call, so it gave the degradation detector no latency sample, and a cut taught it nothing:
it was never drained and kept its share of calls, every one answered degraded (``deadline``). A cut at
the deadline is now an error for the detector (``Fleet.cut_at_deadline``), judged against the peers.
The client here is the service's own (``realtime_client_config``: least outstanding requests, cut calls
read on within a grace) with the detector's default settings, called as ``realtime.matching`` calls it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from llm_client import LLMClient
from llm_client.errors import DeadlineExceeded
from realtime.config import RealtimeSettings
from realtime.llm_pool import realtime_client_config
from serving.simulator.testing import running_simulator

MESSAGES = [
    {"role": "system", "content": "You rank products for a shopper. " * 30},
    {"role": "user", "content": "witch costume"},
]
TIME_SCALE = 0.01
"""A 64-token answer takes about 80 ms on a 2-core machine: well within the deadline."""
SLOWDOWN = 100.0
"""... and about 1.5 s on the slow replica: every call to it is cut."""
SETTINGS = RealtimeSettings()
DEADLINE_S = SETTINGS.default_deadline_ms / 1000
WAVE = 12
"""Calls at once: least outstanding requests spreads them evenly, 4 to each of the 3 replicas."""


@asynccontextmanager
async def pool(*slowdowns: float) -> AsyncIterator[LLMClient]:
    """The service's model client over one simulator replica per ``slowdowns`` entry."""
    async with AsyncExitStack() as stack:
        urls = [
            (await stack.enter_async_context(running_simulator(time_scale=TIME_SCALE, slowdown=s))).url
            for s in slowdowns
        ]
        client = await stack.enter_async_context(LLMClient(realtime_client_config(urls, "m")))
        await client.wait_until_healthy()
        yield client


async def wave(client: LLMClient, step: int) -> list[BaseException | object]:
    """``WAVE`` ranking calls at once, each cut at the service's default deadline."""
    return await asyncio.gather(
        *(
            client.chat(
                MESSAGES,
                routing_key=f"s{step}-{i}",
                max_tokens=SETTINGS.llm_max_tokens,
                deadline_s=DEADLINE_S,
            )
            for i in range(WAVE)
        ),
        return_exceptions=True,
    )


async def test_a_replica_slower_than_the_deadline_is_drained_by_its_cuts() -> None:
    async with pool(1.0, SLOWDOWN, 1.0) as client:
        slow = client.endpoints[1]
        cut = 0
        for step in range(12):  # the default min_samples (20) cut calls on the slow replica: 5 waves
            cut += sum(isinstance(r, DeadlineExceeded) for r in await wave(client, step))
            if slow.drained:
                break
        assert slow.drained, f"not drained after {cut} calls cut at the deadline"
        assert [e.name for e in client.endpoints if e.drained] == [slow.name]
        change = client.degradation.changes[0]
        assert change.endpoint == slow.name and "error rate" in change.reason
        # An error for the detector only: not a failure that ejects, nor one the replica is charged with.
        assert slow.healthy and slow.consecutive_failures == 0 and slow.failed == 0
        assert client.retries == 0
        served = slow.served
        answered = await wave(client, 100)
        assert not any(isinstance(r, BaseException) for r in answered), answered
        assert slow.served == served


async def test_a_deadline_that_cuts_every_replica_alike_drains_none() -> None:
    """Under overload, or with a deadline shorter than every replica's answers, all are cut alike: the
    detector judges a replica against its peers, so none stands out."""
    async with pool(SLOWDOWN, SLOWDOWN, SLOWDOWN) as client:
        for step in range(7):  # past the default min_samples on every replica
            answers = await wave(client, step)
            assert all(isinstance(r, DeadlineExceeded) for r in answers), answers
        assert all(client.degradation.signals(e).samples >= 20 for e in client.endpoints)
        assert not any(e.drained for e in client.endpoints) and client.degradation.drains == 0
