"""Every call the gateway's deadline (``GATEWAY_DEADLINE_S``) cuts is counted as a 504, however far its
answer got, against a real gateway over HTTP in front of a simulator replica slowed so that no answer
comes within the deadline.

A stream cut after its status line was counted as a replica's broken answer (``status="broken"``,
``gateway_broken_answers_total{replica="unknown"}``, a warning that the answer broke off): the 504s on
``/metrics`` missed every deadline cut of a stream, and the broken answers blamed a replica that broke
nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import TIME_SCALE, chat_body, metric, running_gateway, scrape
from tests.gateway.test_overload import CHAT, LONG

DEADLINE_S = 1.0
SLOWDOWN = 10.0
"""One decode step about 25 ms: a ``LONG`` answer (600 tokens) takes some 15 s, far past the deadline,
while a stream's status line comes at once and its first token within a few steps."""


@pytest.fixture
async def slow_replica(http: aiohttp.ClientSession) -> AsyncIterator[str]:
    async with running_simulator(time_scale=float(TIME_SCALE)) as simulator:
        async with http.post(simulator.url + "/admin/config", json={"slowdown": SLOWDOWN}) as response:
            assert response.status == 200, await response.text()
        yield simulator.url


async def test_a_stream_cut_at_the_deadline_counts_as_a_504_like_a_whole_answer_cut_there(
    slow_replica: str, http: aiohttp.ClientSession
) -> None:
    """A whole (not streamed) answer cut at the deadline is answered 504 ``timeout``. A stream cut
    there already has its 200 and some tokens with the caller: it ends with an ``error`` event saying
    the 504 and no ``[DONE]`` (never a silently short answer; until 7 Dec 2026 its connection was
    closed, and a client in front ejected the gateway for it), and it counts as a 504 too, not as a
    broken answer."""
    async with running_gateway([slow_replica], "round_robin", deadline_s=DEADLINE_S) as gw:
        async with http.post(gw.url + CHAT, json=chat_body("a shopper", **LONG)) as response:
            assert response.status == 504, await response.text()
            error = (await response.json())["error"]
        assert (error["type"], error["code"]) == ("timeout", 504)

        async with http.post(gw.url + CHAT, json=chat_body("a shopper", stream=True, **LONG)) as response:
            assert response.status == 200
            received = await response.read()  # a clean end: no ClientPayloadError
        assert received.startswith(b"data:"), received[:200]
        assert b"[DONE]" not in received
        last = orjson.loads(received.rstrip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
        assert (last["error"]["type"], last["error"]["code"]) == ("timeout", 504), last

        text = await scrape(http, gw.url)
        assert metric(text, "gateway_requests_total", path=CHAT, status="504") == 2, text
        assert metric(text, "gateway_requests_total", path=CHAT, status="broken") == 0
        assert metric(text, "gateway_broken_answers_total", replica="unknown") == 0
