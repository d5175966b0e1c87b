"""Fixtures of the simulator's HTTP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post_json(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; the status and the JSON answer."""
    async with http.post(url, json=body) as response:
        return response.status, await response.json()
