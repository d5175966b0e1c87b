"""A gateway that stops (SIGTERM: ``serve_until_stopped`` cleans its runner up) with calls in flight,
against real gateways over HTTP in front of a simulator replica in the test's loop.

It cancelled every call, and each caller got 499 ``cancelled``: a 4xx, which an ``LLMClient`` in front
takes for its own request's fault (``BadRequest``) and does not retry elsewhere, so a gateway restart
turned every prompt in flight into an error result. A stopping gateway answers 503 with
``Retry-After``, which the client retries on another gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import orjson
from aiohttp import web

from gateway.app import CLIENT_KEY, create_app
from gateway.config import GatewaySettings
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import TIME_SCALE, chat_body, key_for, metric, running_gateway, scrape
from tests.gateway.test_overload import CHAT, LONG, until


@asynccontextmanager
async def stoppable_gateway(replica: str) -> AsyncIterator[tuple[str, web.AppRunner]]:
    """A gateway in the test's loop that the test stops itself (``runner.cleanup``, as on SIGTERM)."""
    config = ClientConfig.model_validate({"endpoints": [replica], "policy": "round_robin"})
    runner = web.AppRunner(create_app(GatewaySettings(port=0), config), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield f"http://127.0.0.1:{port}", runner
    finally:
        await runner.cleanup()  # again: a no-op once the test stopped it


async def _calls_in_flight(runner: web.AppRunner) -> bool:
    return runner.app[CLIENT_KEY].in_flight == 1


async def test_a_stopping_gateway_answers_its_calls_in_flight_503_with_retry_after(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_simulator(time_scale=float(TIME_SCALE)) as sim,
        stoppable_gateway(sim.url) as (url, runner),
    ):
        call = asyncio.create_task(http.post(url + CHAT, json=chat_body("a long answer", **LONG)))
        await until(lambda: _calls_in_flight(runner), "the replica computes the call")
        await runner.cleanup()
        async with await call as answer:
            status, retry_after, body = answer.status, answer.headers.get("Retry-After"), await answer.read()
    assert (status, retry_after) == (503, "1"), body
    assert orjson.loads(body)["error"]["type"] == "service_unavailable"


async def test_a_client_in_front_retries_a_stopping_gateways_call_on_another_gateway(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_simulator(time_scale=float(TIME_SCALE)) as sim,
        stoppable_gateway(sim.url) as (stopping, runner),
        running_gateway([sim.url], "round_robin") as other,
    ):
        gateways = [stopping, other.url]
        config = ClientConfig.model_validate(
            {"endpoints": gateways, "policy": "session_affinity", "stream": False}
        )
        async with LLMClient(config) as client:
            answer = asyncio.create_task(
                client.chat(
                    [{"role": "user", "content": "a long answer"}],
                    routing_key=key_for(stopping, gateways),  # sent to the gateway that stops
                    max_tokens=LONG["max_tokens"],
                    extra_body={"ignore_eos": True},
                )
            )
            await until(lambda: _calls_in_flight(runner), "the stopping gateway forwards the call")
            await runner.cleanup()
            completion = await answer
        assert completion.text
        assert metric(await scrape(http, other.url), "gateway_requests_total", path=CHAT, status="200") == 1
