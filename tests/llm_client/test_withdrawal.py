"""A replica taken from the client's fleet with ``withdraw_after_s`` (a capacity hand-off): the calls
still running on it then are cut, their requests closed (the replica aborts them and frees their
slots, its ``/metrics`` says so), and each is answered by a replica the client kept, without spending
an attempt, the retry budget or the left replica's good name. Simulated replicas over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from llm_client import LLMClient
from llm_client.models import Completion
from serving.simulator.testing import running_simulator
from tests.helpers import until
from tests.llm_client.slow_calls import (
    MESSAGES,
    SLOW,
    aborted,
    calls_spread_over,
    config,
    held,
    two_replicas,
)


@pytest.mark.parametrize("grace_s", [0.0, 5.0], ids=["no-grace", "with-a-cut-grace"])
async def test_calls_on_a_withdrawn_replica_are_cut_there_and_answered_by_a_kept_one(grace_s: float) -> None:
    async with two_replicas(grace_s=grace_s) as (leaving, kept, client):
        calls, on_leaving = await calls_spread_over(client, leaving.url)
        left = next(e for e in client.fleet.endpoints if e.url == leaving.url)

        client.set_endpoints([kept.url], withdraw_after_s=0.3)
        await asyncio.sleep(0.1)
        assert await held(leaving.url) == on_leaving, "cut before the time it was given"

        async def freed() -> bool:
            return await held(leaving.url) == 0

        await until(freed, 3.0)  # a grace would have kept reading: the replica's new owner gets it free
        assert await aborted(leaving.url) == on_leaving
        answers = await asyncio.gather(*calls)

    assert all(a.endpoint == client.fleet.endpoints[0].name for a in answers)
    assert client.withdrawn == on_leaving
    assert client.retries == 0
    assert (left.failed, left.consecutive_failures, left.healthy) == (0, 0, True)


async def test_a_replica_back_before_its_withdrawal_keeps_its_calls() -> None:
    async with two_replicas(SLOW / 4) as (leaving, kept, client):
        calls, on_leaving = await calls_spread_over(client, leaving.url)
        client.set_endpoints([kept.url], withdraw_after_s=0.3)
        client.set_endpoints([leaving.url, kept.url])  # a split that moved it back at once
        await asyncio.sleep(0.5)
        assert await held(leaving.url) == on_leaving
        await asyncio.gather(*calls)
        assert await aborted(leaving.url) == 0
    assert client.withdrawn == 0


async def test_a_caller_cancelling_a_withdrawn_call_is_still_cancelled() -> None:
    """A cancel of the caller's own, landing with the withdrawal, wins: the call ends cancelled, not
    moved (the withdrawal must not swallow it, as asyncio.timeout does not swallow others' cancels)."""
    async with two_replicas() as (leaving, kept, client):
        calls, on_leaving = await calls_spread_over(client, leaving.url)
        left = next(e for e in client.fleet.endpoints if e.url == leaving.url)
        on_it = list(left.attempts)
        client.set_endpoints([kept.url], withdraw_after_s=0.0)
        for task in on_it:
            task.cancel()  # before the withdrawal runs: both cancels pend on the task
        done = await asyncio.gather(*calls, return_exceptions=True)
        cancelled = [t for t in calls if t.cancelled()]
        assert len(cancelled) == on_leaving
        assert all(isinstance(d, Completion) for t, d in zip(calls, done, strict=True) if not t.cancelled())
    assert client.withdrawn == 0


async def test_a_replica_back_and_handed_over_again_takes_the_calls_of_its_first_stay_with_it() -> None:
    async with two_replicas() as (leaving, kept, client):
        calls, on_leaving = await calls_spread_over(client, leaving.url)
        client.set_endpoints([kept.url], withdraw_after_s=0.3)
        client.set_endpoints([leaving.url, kept.url])  # back before its withdrawal: its calls stay
        await asyncio.sleep(0.5)
        assert await held(leaving.url) == on_leaving
        client.set_endpoints([kept.url], withdraw_after_s=0.2)  # handed over again

        async def freed() -> bool:
            return await held(leaving.url) == 0

        await until(freed, 3.0)
        answers = await asyncio.gather(*calls)
    assert {a.endpoint for a in answers} == {client.fleet.endpoints[0].name}
    assert client.withdrawn == on_leaving


async def test_a_call_made_by_a_task_that_swallowed_a_cancel_is_still_moved() -> None:
    """The withdrawal's cancel is told apart by the cancel count at the attempt's start, not by a count
    of zero: a task may carry a cancel a library swallowed (redis-py does, ``pipeline.cancellation``)."""
    async with (
        running_simulator(time_scale=SLOW) as leaving,
        running_simulator(time_scale=SLOW / 10) as kept,
        LLMClient(config([leaving.url])) as client,
    ):

        async def carrying_a_swallowed_cancel() -> Completion:
            me = asyncio.current_task()
            assert me is not None
            me.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)  # swallowed without uncancel(), as a library might
            assert me.cancelling() == 1
            return await client.chat(MESSAGES, routing_key="k", max_tokens=200)

        call = asyncio.create_task(carrying_a_swallowed_cancel())

        async def on_leaving() -> bool:
            return await held(leaving.url) == 1

        await until(on_leaving, 5.0)
        client.set_endpoints([kept.url], withdraw_after_s=0.0)
        answer = await call
    assert answer.endpoint == client.fleet.endpoints[0].name
    assert client.withdrawn == 1


async def test_a_replica_dropped_again_to_let_its_calls_finish_is_not_cut_by_an_earlier_plan() -> None:
    async with two_replicas() as (leaving, kept, client):
        calls, on_leaving = await calls_spread_over(client, leaving.url)
        client.set_endpoints([kept.url], withdraw_after_s=0.3)
        client.set_endpoints([leaving.url, kept.url])
        client.set_endpoints([kept.url])  # the newest drop lets them finish
        await asyncio.sleep(0.6)
        assert await held(leaving.url) == on_leaving
        await asyncio.gather(*calls)
    assert client.withdrawn == 0
