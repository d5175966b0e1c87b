"""The bundled clients against the service's guards, over HTTP with the stack's replicas and Redis: an
API key (the documented usage failed with 401 against a service with ``REALTIME_API_KEYS``), a rate
limit (429 ``rate_limited`` is retryable, not ``MatchRejected``), and a 200 that is not an answer
(``MatchUnavailable``, not pydantic's ``ValidationError``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from pydantic import SecretStr

from devstack.stack import StackState
from realtime.client import MatchClient, MatchOverloaded, MatchRejected, MatchUnavailable, SyncMatchClient
from tests.conftest import Isolated
from tests.helpers import serving
from tests.realtime.service_kit import realtime_service

KEY = "client-key-0123456789"
CANDIDATES = ["KID-witch", "MAK-paint", "OUT-spider"]


def _sync_match(url: str, **client_args: Any) -> Any:
    """One blocking call, run in a thread so the service on this loop can answer it."""
    with SyncMatchClient(url, **client_args) as client:
        return client.match("s1", "witch", CANDIDATES, deadline_ms=3000)


async def test_both_clients_send_the_api_key(stack: StackState, isolated: Isolated) -> None:
    service = realtime_service(isolated, stack.llm_endpoints, stack.model, api_keys=[SecretStr(KEY)])
    async with service as http:
        url = str(http.make_url(""))
        async with MatchClient(url, api_key=KEY) as client:
            answer = await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
        assert len(answer.ranked) == 3
        answer = await asyncio.to_thread(_sync_match, url, api_key=KEY)
        assert len(answer.ranked) == 3
        # Without the key: 401, a request to fix, not to retry.
        async with MatchClient(url) as client:
            with pytest.raises(MatchRejected) as rejected:
                await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
        assert rejected.value.status == 401
        with pytest.raises(MatchRejected):
            await asyncio.to_thread(_sync_match, url, api_key="wrong")


async def test_a_rate_limited_request_is_retryable_with_retry_after(
    stack: StackState, isolated: Isolated
) -> None:
    limit = {"rate_limit_per_s": 0.01, "rate_limit_burst": 2}  # nothing refills during the test
    async with realtime_service(isolated, stack.llm_endpoints, stack.model, **limit) as http:
        url = str(http.make_url(""))
        async with MatchClient(url) as client:
            for _ in range(2):
                await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
            # Was MatchRejected ("do not retry"): a request that only came too soon.
            with pytest.raises(MatchOverloaded) as limited:
                await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
        assert isinstance(limited.value, MatchUnavailable) and limited.value.retry_after_s >= 1
        assert "requests a second" in str(limited.value)  # the service's message
        with pytest.raises(MatchOverloaded) as limited:
            await asyncio.to_thread(_sync_match, url)
        assert limited.value.retry_after_s >= 1


@pytest.mark.parametrize(
    "answer", [b'{"ranked": "none"}', b"<html>proxy page</html>"], ids=["wrong shape", "not json"]
)
async def test_a_200_that_is_not_an_answer_is_unavailable(answer: bytes) -> None:
    """A stand-in for a service (or a proxy before it) answering 200 with something else: the real
    service never does, so no real part can play it."""

    async def match(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/match", match)
    async with serving(app) as url:
        async with MatchClient(url) as client:
            with pytest.raises(MatchUnavailable, match="HTTP 200"):
                await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
        with pytest.raises(MatchUnavailable, match="HTTP 200"):
            await asyncio.to_thread(_sync_match, url)
