"""What the gateway refuses at its edge: fields only the serving side may write.

A simulator generation replica sits behind the gateway, and a canary HTTP server stands for anything
else inside the serving network. A forged ``generation_only`` request named the canary as its context
server, and the replica POSTed to it (a request from inside the serving network, chosen by a caller).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.route import SERVER_ONLY_FIELDS
from serving.simulator.disagg import OpaqueState
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import chat_body, running_gateway
from tests.helpers import serving


@asynccontextmanager
async def canary() -> AsyncIterator[tuple[str, list[str]]]:
    """A server inside the serving network that no caller should be able to make a replica call."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"error": "canary"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    async with serving(app) as url:
        yield url, hits


def forged_handover(ctx_url: str) -> dict[str, Any]:
    state = OpaqueState(ctx_url=ctx_url, ctx_request_id=1, block_hashes_count=4)
    return {
        "request_type": "generation_only",
        "first_gen_tokens": [1],
        "ctx_request_id": 1,
        "opaque_state": state.encode(),
    }


async def perf(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/perf_metrics") as response:
        records: list[dict[str, Any]] = await response.json()
    return records


async def test_a_forged_pd_handover_is_refused_and_reaches_no_replica() -> None:
    async with (
        canary() as (canary_url, hits),
        running_simulator(role="generation", time_scale=0.0) as gen,
        running_gateway([gen.url], "round_robin") as gw,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body("hi", max_tokens=8, disaggregated_params=forged_handover(canary_url))
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            status, answer = r.status, await r.json()
        assert status == 400, answer
        assert answer["error"]["param"] == "disaggregated_params"
        assert hits == [], "the replica called a URL the caller chose"
        assert await perf(gen.url) == []


@pytest.mark.parametrize("field", sorted(SERVER_ONLY_FIELDS))
async def test_fields_only_the_serving_side_writes_are_refused_with_a_clear_400(field: str) -> None:
    value: object = {"remote_host": "10.0.0.1", "remote_port": 5557} if field != "cache_salt" else "other"
    async with (
        running_simulator(time_scale=0.0) as replica,
        running_gateway([replica.url], "round_robin") as gw,
        aiohttp.ClientSession() as http,
    ):
        for stream in (False, True):
            body = chat_body("hi", max_tokens=8, stream=stream, **{field: value})
            async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body)) as r:
                status, answer = r.status, await r.json()
            assert status == 400 and answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["param"] == field and field in answer["error"]["message"]
        assert await perf(replica.url) == [], "nothing reached the replica"
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body("hi", max_tokens=8)) as r:
            assert r.status == 200, "the same request without the field is served"
