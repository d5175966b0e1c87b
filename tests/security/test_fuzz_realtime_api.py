"""Schema-driven fuzzing of the real-time HTTP API from its own OpenAPI spec (Schemathesis).

Schemathesis generates valid and invalid requests for every operation in ``realtime/openapi.json``;
the service runs for real (aiohttp on a port, a simulator replica, the local Redis) in a thread of its
own. Every answer must be a documented status with the documented body and content type; never a 5xx,
never a hang (the file's timeout); and every 4xx must be a JSON ``ErrorResponse`` naming the problem.
Examples are bounded so the file takes well under a minute on two cores.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi import checks as openapi_checks

from devstack.processes import port_open
from realtime.config import RealtimeSettings
from realtime.models import ErrorResponse
from realtime.openapi import openapi_spec
from realtime.service import create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from sinks.config import SinkSettings

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # about 30 s on two cores

schema = schemathesis.openapi.from_dict(openapi_spec())

CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.response_headers_conformance,
]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The service on a free port, in a thread with its own event loop, until the module ends."""
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        if not port_open(6379):
            raise RuntimeError("the fuzz test needs the local Redis on 127.0.0.1:6379")
        async with running_simulator(time_scale=0.001) as sim:
            app = create_app(
                RealtimeSettings(default_deadline_ms=500),
                llm_config=realtime_client_config([sim.url], "m"),
                sinks=SinkSettings(redis_url="redis://127.0.0.1:6379/0", redis_key_prefix="fuzz:"),
            )
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
            ready["url"] = f"http://127.0.0.1:{port}"
            started.set()
            try:
                await stop.wait()
            finally:
                await runner.cleanup()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # surfaced to the test below
            ready["error"] = exc
            started.set()

    thread = threading.Thread(target=run, name="realtime-under-fuzz", daemon=True)
    thread.start()
    assert started.wait(60), "the service did not start"
    if "error" in ready:
        raise ready["error"]
    try:
        yield str(ready["url"])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_answers_every_generated_request_as_documented(
    case: schemathesis.Case[Any], base_url: str
) -> None:
    response = case.call(base_url=base_url, timeout=10)
    case.validate_response(response, checks=CHECKS)
    if 400 <= response.status_code < 500:
        error = ErrorResponse.model_validate_json(response.content)
        assert error.error.message, "a 4xx says what was wrong"
