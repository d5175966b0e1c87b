"""Slow calls spread over simulated replicas, and what a replica says it holds and aborted: for the tests
of a replica taken from a client's fleet (``tests/llm_client/test_withdrawal.py``, the capacity
hand-off in ``tests/capacity/test_pool_handoff.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.models import Completion
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.helpers import served_total, until

MESSAGES = [
    {"role": "system", "content": "You describe products. " * 40},
    {"role": "user", "content": "a long catalogue page"},
]
SLOW = 1.0
"""Simulator time scale at which a 200-token answer takes about 5 s on this machine."""
CALLS = 8


def config(urls: list[str], grace_s: float = 0.0) -> ClientConfig:
    return ClientConfig(
        endpoints=urls,
        timeouts=Timeouts(connect_s=1, attempt_s=60, deadline_s=60, cut_grace_s=grace_s),
        # one attempt and no retry budget: a move that spent either would fail the call
        retry=RetrySettings(max_attempts=1, budget_ratio=0, budget_min_tokens=0),
        health=HealthSettings(interval_s=0.05),
    )


async def held(url: str) -> float:
    """Requests the replica holds: running or waiting for a slot."""
    metrics = f"{url}/metrics"
    return await served_total(metrics, "sim_num_requests_running") + await served_total(
        metrics, "sim_num_requests_waiting"
    )


async def aborted(url: str) -> float:
    return await served_total(f"{url}/metrics", "sim_request_errors_total", reason="aborted")


async def calls_spread_over(client: LLMClient, leaving: str) -> tuple[list[asyncio.Task[Completion]], int]:
    """``CALLS`` slow calls on the client's replicas; how many of them run on ``leaving``."""
    calls = [
        asyncio.create_task(client.chat(MESSAGES, routing_key=f"product-{i}", max_tokens=200))
        for i in range(CALLS)
    ]

    async def all_running() -> bool:
        return sum(e.outstanding for e in client.fleet.endpoints) == CALLS

    await until(all_running, 5.0)
    on_leaving = next(e.outstanding for e in client.fleet.endpoints if e.url == leaving)
    assert 0 < on_leaving < CALLS, f"the routing put {on_leaving} of {CALLS} calls on one replica"

    async def arrived() -> bool:
        return await held(leaving) == on_leaving

    await until(arrived, 5.0)
    return calls, on_leaving


@contextlib.asynccontextmanager
async def two_replicas(
    time_scale: float = SLOW, *, grace_s: float = 0.0
) -> AsyncIterator[tuple[RunningSimulator, RunningSimulator, LLMClient]]:
    """The replica a test takes from the client (``leaving``), the one it keeps, and the client."""
    async with (
        running_simulator(time_scale=time_scale) as leaving,
        running_simulator(time_scale=time_scale) as kept,
        LLMClient(config([leaving.url, kept.url], grace_s)) as client,
    ):
        yield leaving, kept, client
