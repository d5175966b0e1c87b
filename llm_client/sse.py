"""Minimal reader of OpenAI-style server-sent events (``data: {json}`` lines, ending ``data: [DONE]``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from llm_client.errors import EndpointUnavailable


async def read_sse_json(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    async for raw_line in stream:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise EndpointUnavailable(f"malformed stream chunk: {exc}") from None
        if isinstance(chunk, dict):
            if "error" in chunk:
                raise EndpointUnavailable(f"error in stream: {chunk['error']}")
            yield chunk
