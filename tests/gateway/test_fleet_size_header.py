"""``x-gateway-routable-replicas`` on an answer kept for a repeated ``Idempotency-Key``, against a real
gateway over HTTP in front of two simulator replicas in the test's loop.

An ``LLMClient`` in front sizes its admission limit by that header (``llm_client.gateway_headers``). A
kept answer replayed the count from when it first came, up to the TTL (600 s) before: a client restarted
after a replica died read the old fleet's size from its first repeats. The count is the gateway's now.
"""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack

import aiohttp

from llm_client.gateway_headers import FLEET_SIZE_HEADER
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import chat_body, running_gateway
from tests.gateway.test_overload import post, until


async def _routable(http: aiohttp.ClientSession, gateway: str) -> int:
    async with http.get(gateway + "/health") as r:
        return int((await r.json())["routable_replicas"])


async def test_a_kept_answer_says_how_many_replicas_are_routable_now(http: aiohttp.ClientSession) -> None:
    body = chat_body("shopper 21: viewed a tent", max_tokens=5)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    async with running_simulator(time_scale=0.0) as kept, AsyncExitStack() as stopped:
        dying = await stopped.enter_async_context(running_simulator(time_scale=0.0))
        async with running_gateway([kept.url, dying.url], "round_robin") as gw:
            status, headers, _ = await post(http, gw.url, body, **key)
            assert (status, headers[FLEET_SIZE_HEADER]) == (200, "2")
            await stopped.aclose()  # a replica dies

            async def one_left() -> bool:
                """After a call: the dead replica refuses its connection, and is ejected at once."""
                assert (await post(http, gw.url, chat_body("shopper 22", max_tokens=5)))[0] == 200
                return await _routable(http, gw.url) == 1

            await until(one_left, "the dead replica is ejected")
            status, headers, _ = await post(http, gw.url, body, **key)
            assert (status, headers["x-gateway-idempotent"]) == (200, "reused")
            assert headers[FLEET_SIZE_HEADER] == "1"
