"""The real-time service as a test talks to it: the app over a real local HTTP server, against the
test's own replicas and the stack's Redis under the test's key prefix."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from realtime.config import RealtimeSettings
from realtime.service import create_app, realtime_client_config
from tests.conftest import Isolated


@asynccontextmanager
async def realtime_service(
    isolated: Isolated, endpoints: list[str], model: str = "m", **settings: Any
) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(
        RealtimeSettings(**settings),
        llm_config=realtime_client_config(endpoints, model),
        sinks=isolated.sinks(),
    )
    async with TestClient(TestServer(app)) as client:
        yield client
