"""Requests whose handlers run in one event-loop tick, against a real gateway over HTTP in front of a
simulator replica in the test's loop.

Admission judged a request in its handler but queued it later, in its flight's task: requests of the
same tick were each judged without those before them, which had not queued yet. The requests here are
written on their own connections before the gateway's loop reads its sockets again, so their handlers
run one after another with no flight task between them; saturation is made, not timed (a stream that
holds the only slot, ``SlotHolder``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import TIME_SCALE, chat_body, metric, running_gateway, scrape
from tests.gateway.test_overload import (
    PATIENT,
    SHORT,
    SlotHolder,
    _equals,
    post,
    session_headers,
    until,
    waiting,
)


@pytest.fixture
async def replica() -> AsyncIterator[str]:
    async with running_simulator(time_scale=float(TIME_SCALE)) as simulator:
        yield simulator.url


def raw_request(body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 chat request, body included, in one write."""
    data = orjson.dumps(body)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{head}Connection: close\r\n\r\n"
    ).encode() + data


async def in_one_tick(url: str, *requests: bytes) -> list[asyncio.Task[int]]:
    """Send ``requests`` on connections of their own, all written before the gateway reads any: the
    status of each, as a task."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [await asyncio.open_connection(host, int(port)) for _ in requests]
    for (_, writer), request in zip(connections, requests, strict=True):
        writer.write(request)
    return [asyncio.create_task(_status(reader, writer)) for reader, writer in connections]


async def _status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    try:
        status = int((await reader.readline()).split()[1])
        await reader.read()  # the rest, up to the gateway's close
        return status
    finally:
        writer.close()


async def test_a_newer_version_arriving_in_one_tick_with_another_request_keeps_the_session_answered(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """The only slot held, version 1 of session s7 queued, the queue full (one place), and another
    shopper's request and s7's version 2 arriving in one tick. Version 2 was judged admissible (its
    older call's place would be its own) and superseded version 1 (409); then the other request's
    flight took the place first and version 2's own flight was refused queue_full (429): the session
    got no answer. Judged and queued in one step, the other request finds the queue full and is
    refused, and version 2 takes version 1's place."""
    async with running_gateway(
        [replica], "round_robin", per_replica_in_flight=1, max_waiting=1, max_wait_s=PATIENT
    ) as gw:
        async with SlotHolder(http, gw.url):
            older = asyncio.create_task(
                post(http, gw.url, chat_body("shopper 7, version 1", **SHORT), **session_headers("s7", 1))
            )
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "version 1 waits")
            other, newer = await in_one_tick(
                gw.url,
                raw_request(chat_body("shopper 8", **SHORT), {}),
                raw_request(chat_body("shopper 7, version 2", **SHORT), session_headers("s7", 2)),
            )
            assert (await older)[0] == 409
            assert await other == 429, "the queue was full: version 2 holds version 1's place"
        assert await newer == 200, "the session's newest version is answered"
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_superseded_total", stage="queued") == 1
        assert metric(text, "gateway_refused_total", priority="normal", reason="queue_full") == 1
        assert metric(text, "gateway_admission_active") == 0


async def test_a_call_superseded_in_the_tick_it_took_a_free_slot_gives_the_slot_back(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """Version 1 takes the only slot, free, on arrival; version 2 of the same session, in the same tick,
    supersedes it before its flight's task ever ran. That task never takes its place over, so the slot
    is given back for it (``Admission.leave``): version 2 is served, and so is the next request."""
    async with running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=PATIENT) as gw:
        older, newer = await in_one_tick(
            gw.url,
            raw_request(chat_body("shopper 9, version 1", **SHORT), session_headers("s9", 1)),
            raw_request(chat_body("shopper 9, version 2", **SHORT), session_headers("s9", 2)),
        )
        assert (await older, await newer) == (409, 200)
        assert (await post(http, gw.url, chat_body("shopper 10", **SHORT)))[0] == 200
        assert metric(await scrape(http, gw.url), "gateway_admission_active") == 0
