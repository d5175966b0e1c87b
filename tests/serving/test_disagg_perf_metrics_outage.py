"""``GET /perf_metrics`` of the disaggregated stand-in while one of its servers is unreachable, against
simulator context and generation replicas over HTTP.

Each server's ``/perf_metrics`` drains it. The stand-in gathered the drains without
``return_exceptions``: one unreachable server failed the call, and the records already drained from the
others were discarded, so the requests they belonged to were never answered, even once the server was
back. They are kept for the next call now, which answers them when every server answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from devstack.processes import free_port
from serving.disagg_router.app import create_app
from serving.disagg_router.config import DisaggConfig
from serving.simulator.app import create_app as simulator_app
from serving.simulator.config import SimulatorConfig
from serving.simulator.testing import running_simulator
from tests.helpers import serving
from tests.llm_client.test_routing_pd_aware import words
from tests.serving.test_disagg_router import EVENTS, YAML, chat_stream, get_json


@asynccontextmanager
async def simulator_on(port: int, **settings: Any) -> AsyncIterator[None]:
    """A simulator replica on ``port`` (``running_simulator`` picks a free port; this one comes back on
    the port the stand-in was configured with)."""
    app = simulator_app(SimulatorConfig(host="127.0.0.1", port=port, **settings))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


async def test_records_drained_while_a_server_is_down_are_answered_once_it_is_back() -> None:
    away_port = free_port()
    away = f"http://127.0.0.1:{away_port}"
    async with (
        running_simulator(role="context", time_scale=0.0, **EVENTS) as ctx,
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as gen,
    ):
        config = DisaggConfig.load(YAML).with_overrides(
            context_urls=[ctx.url, away], generation_urls=[gen.url], perf_metrics_max_requests=100
        )
        async with serving(create_app(config, retry_interval_s=0.05)) as url, aiohttp.ClientSession() as http:
            await chat_stream(http, url, words(3000))
            assert ctx.replica.engine.stats.served == 1, "the request went through the server that is up"

            async with http.get(f"{url}/perf_metrics") as response:
                assert response.status == 500, await response.text()
                assert away in (await response.json())["detail"]
            # Both servers that answered were drained by that call: their records are the stand-in's now.
            assert await get_json(http, f"{ctx.url}/perf_metrics") == []
            assert await get_json(http, f"{gen.url}/perf_metrics") == []

            async with simulator_on(away_port, role="context", time_scale=0.0, **EVENTS):
                (record,) = await get_json(http, f"{url}/perf_metrics")
                assert (record["ctx_server"], record["gen_server"]) == (ctx.url, gen.url)
                assert record["ctx_perf_metrics"]["request_type"] == "context_only"
                assert record["gen_perf_metrics"]["request_type"] == "generation_only"
                assert record["timing"] is not None
                assert await get_json(http, f"{url}/perf_metrics") == [], "answered once"
