"""The gateway's deadline (``GATEWAY_DEADLINE_S``) bounds the whole request, the wait for an admission
slot included, against a real gateway over HTTP in front of a simulator replica in the test's loop.

The deadline started when the request was sent to a replica, after its wait in the queue, so a call
could last ``max_wait_s`` plus the deadline. Saturation is made, not timed: one stream holds the only
slot (``SlotHolder``), and a high-priority stream queued before or after the call under test takes the
slot next and holds it up to its own deadline, counted from its own arrival.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import TIME_SCALE, chat_body, metric, running_gateway, scrape
from tests.gateway.test_overload import (
    CHAT,
    HOLD,
    LONG,
    PATIENT,
    SHORT,
    SlotHolder,
    _equals,
    post,
    until,
    waiting,
)

DEADLINE_S = 1.5
"""Longer than a ``LONG`` answer (600 tokens) takes at the test's time scale: sent with all of it, such
a call is answered."""
QUEUE: dict[str, Any] = {"per_replica_in_flight": 1, "max_waiting": 2, "max_wait_s": PATIENT}
"""One slot, and room in the queue for the call and the stream."""


@pytest.fixture
async def replica() -> AsyncIterator[str]:
    async with running_simulator(time_scale=float(TIME_SCALE)) as simulator:
        yield simulator.url


def _high_priority_stream(http: aiohttp.ClientSession, gateway: str) -> asyncio.Task[aiohttp.ClientResponse]:
    return asyncio.create_task(
        http.post(
            gateway + CHAT, json=chat_body("a purchase", stream=True, **HOLD), headers={"x-priority": "high"}
        )
    )


async def test_a_call_whose_deadline_passes_while_it_waits_is_answered_504_and_never_sent(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """The call waits behind a stream that arrived after it: that stream holds the slot past the call's
    deadline, so the call is answered 504 then, unsent. It waited for the slot, then had a deadline
    of its own, and was answered 200 well past its deadline."""
    received = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    async with running_gateway([replica], "round_robin", deadline_s=DEADLINE_S, **QUEUE) as gw:
        async with SlotHolder(http, gw.url):
            call = asyncio.create_task(post(http, gw.url, chat_body("shopper 30", **SHORT)))
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "the call waits")
            later = _high_priority_stream(http, gw.url)
            await until(lambda: _equals(waiting(http, gw.url, "high"), 1), "the stream waits, ahead of it")
        status, _, body = await call
        (await later).close()
        assert status == 504, (status, body)
        assert body["error"]["type"] == "timeout"
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_refused_total", priority="normal", reason="waited") == 0
    sent = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat") - received
    assert sent == 2, "only the two streams reached the replica"


async def test_a_call_granted_late_is_sent_with_what_is_left_of_its_deadline(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """The call waits behind a stream that arrived just before it and holds the slot up to that
    stream's deadline: the call gets the slot with next to nothing of its own deadline left, too little
    for its answer. Sent with a whole deadline of its own, it was answered 200."""
    async with running_gateway([replica], "round_robin", deadline_s=DEADLINE_S, **QUEUE) as gw:
        async with SlotHolder(http, gw.url):
            earlier = _high_priority_stream(http, gw.url)
            await until(lambda: _equals(waiting(http, gw.url, "high"), 1), "the stream waits")
            call = asyncio.create_task(post(http, gw.url, chat_body("shopper 31", **LONG)))
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "the call waits, behind it")
        status, _, body = await call
        (await earlier).close()
        assert status == 504, (status, body)
        assert body["error"]["type"] == "timeout"
