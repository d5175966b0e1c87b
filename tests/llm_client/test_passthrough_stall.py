"""A pass-through (the gateway's forward) against a simulator replica over HTTP: the attempt timeout
bounds a stall, not the whole answer. As aiohttp's ``total`` it cut a healthy stream longer than
``attempt_s`` mid-answer and counted that against the replica, so a shopper's long streams ejected it."""

from __future__ import annotations

import time

import orjson

from llm_client import ClientConfig, LLMClient
from llm_client.config import Timeouts
from llm_client.routing import RouteRequest
from serving.simulator.testing import running_simulator


async def test_a_stream_longer_than_the_attempt_timeout_is_passed_on_whole() -> None:
    async with (
        running_simulator(time_scale=0.05) as replica,  # 600 tokens: well over a second of wall time
        LLMClient(
            ClientConfig(
                endpoints=[replica.url], timeouts=Timeouts(connect_s=1, attempt_s=0.4, deadline_s=20)
            )
        ) as client,
    ):
        body = {
            "model": client.config.model,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.monotonic()
        route = RouteRequest("s1", "tell me a long story", 6, 600)
        async with client.forward("/v1/chat/completions", orjson.dumps(body), route) as answer:
            assert answer.status == 200
            data = b"".join([chunk async for chunk in answer.chunks()])
        took_s = time.monotonic() - started
        assert took_s > 0.4, "the stream outlasted the attempt timeout (else this test shows nothing)"
        assert data.rstrip().endswith(b"data: [DONE]")
        assert data.count(b'"finish_reason":"length"') == 1
        (endpoint,) = client.endpoints
        assert endpoint.routable and endpoint.ejections == 0
