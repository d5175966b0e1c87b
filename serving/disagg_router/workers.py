"""HTTP to the context and generation servers, with TensorRT-LLM's retry rule
(``OpenAIHttpClient._post_with_retry``): a request that failed in transport (no answer, or a 5xx to a
non-streamed request) is sent again to the same server, up to ``max_retries`` times, ``retry_interval_s``
apart; a 4xx is the request's own fault and is never retried; nothing is retried once an answer started
to stream. Every failure surfaces as ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from serving.disagg_router.errors import UpstreamError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 1
    retry_interval_s: float = 1.0
    """TensorRT-LLM's ``retry_interval_sec``."""


class Workers:
    """One session to every worker; owned by the app (``close`` on shutdown)."""

    def __init__(self, session: aiohttp.ClientSession, retry: RetryPolicy) -> None:
        self.session = session
        self.retry = retry

    async def post_json(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed request's JSON answer; raises ``UpstreamError``."""
        for attempt in range(self.retry.max_retries + 1):
            try:
                async with self.session.post(url, data=orjson.dumps(body), headers=_JSON) as response:
                    raw = await response.read()
                    if response.status == 200:
                        answer = orjson.loads(raw)
                        if isinstance(answer, dict):
                            return answer
                        raise UpstreamError(url, 200, "the answer is not a JSON object")
                    error = UpstreamError(url, response.status, raw[:2048].decode(errors="replace"))
                    if response.status < 500 or attempt == self.retry.max_retries:
                        raise error
            except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
                if attempt == self.retry.max_retries:
                    raise UpstreamError(url, 0, repr(exc)) from exc
            log.warning("%s failed, retry %d of %d", url, attempt + 1, self.retry.max_retries)
            await asyncio.sleep(self.retry.retry_interval_s)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @asynccontextmanager
    async def open_stream(self, url: str, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        """A streamed request's response, once its status is 200 and it is an event stream;
        connection failures before that are retried."""
        for attempt in range(self.retry.max_retries + 1):
            try:
                response = await self.session.post(url, data=orjson.dumps(body), headers=_JSON)
            except (aiohttp.ClientError, OSError) as exc:
                if attempt == self.retry.max_retries:
                    raise UpstreamError(url, 0, repr(exc)) from exc
                log.warning("%s failed, retry %d of %d", url, attempt + 1, self.retry.max_retries)
                await asyncio.sleep(self.retry.retry_interval_s)
                continue
            try:
                if response.status != 200:
                    detail = (await response.read())[:2048].decode(errors="replace")
                    raise UpstreamError(url, response.status, detail)
                if "text/event-stream" not in response.headers.get("Content-Type", ""):
                    raise UpstreamError(url, 200, "a streamed request was answered without an event stream")
                yield response
                return
            finally:
                response.release()

    async def kv_cache_events(self, server: str) -> list[dict[str, Any]] | None:
        """Drain ``server``'s KV cache events; None (and a warning) when it cannot be polled, as
        TensorRT-LLM's ``poll_and_update`` logs and carries on."""
        try:
            async with self.session.post(f"{server}/kv_cache_events") as response:
                events = orjson.loads(await response.read()) if response.status == 200 else None
        except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            log.warning("Failed to poll KV cache events from %s: %r", server, exc)
            return None
        if not isinstance(events, list):
            log.warning("Failed to poll KV cache events from %s: not a list of events", server)
            return None
        return events

    async def perf_metrics(self, server: str) -> list[dict[str, Any]]:
        """``server``'s ``GET /perf_metrics`` (drains it); raises ``UpstreamError``."""
        try:
            async with self.session.get(f"{server}/perf_metrics") as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"{server}/perf_metrics", 0, repr(exc)) from exc
        records = orjson.loads(raw) if status == 200 else None
        if not isinstance(records, list):
            raise UpstreamError(f"{server}/perf_metrics", status, raw[:200].decode(errors="replace"))
        return records


_JSON = {"Content-Type": "application/json"}
