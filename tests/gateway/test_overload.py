"""The gateway under overload, against a real simulator replica process over HTTP: a session's newer
version supersedes its older call (dropped from the queue, or its upstream request closed: the replica
counts the abort), admission refuses lower priorities first with 429 and ``Retry-After``, and an
``Idempotency-Key`` makes a repeat join or reuse the call it repeats, so the replica sees one request
even when the first caller is SIGKILLed mid-call.

Saturation is made, not timed: the test holds the only slot with a stream it does not read to its end,
so what waits and what is refused depends on the order of arrivals alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import Priority
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from llm_client.errors import SupersededByNewer
from serving.simulator.launch import REPO_ROOT, SimulatorFleet
from tests.gateway.test_gateway import (
    TIME_SCALE,
    chat_body,
    metric,
    replica_answering,
    running_gateway,
    scrape,
)

CHAT = "/v1/chat/completions"
LONG = {"max_tokens": 600, "ignore_eos": True}
"""A 600-token answer: over a second at the test's time scale, long enough to act while it runs."""
HOLD = {"max_tokens": 3000, "ignore_eos": True}
"""A slot holder's stream: about 5.6 s at this time scale, where a ``LONG`` one (1.2 s) could end, and
free its slot, while a loaded machine was still between a test's steps."""
SHORT = {"max_tokens": 8}
PATIENT = {"high": 60.0, "normal": 60.0, "low": 60.0}
"""Wait bounds no request reaches in these tests, unless a test sets its own."""


@pytest.fixture(scope="module")
async def replica() -> AsyncIterator[str]:
    async with SimulatorFleet(1, "--time-scale", TIME_SCALE) as fleet:
        yield fleet.urls[0]


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it holds (a bound on a wait, not a timing assertion)."""
    async with asyncio.timeout(20):
        while not await check():
            await asyncio.sleep(0.02)


def session_headers(session: str, version: int | str, **more: str) -> dict[str, str]:
    return {"x-session-id": session, "x-session-version": str(version), **more}


async def holding_the_slot(http: aiohttp.ClientSession, url: str, session: str, version: int) -> Any:
    """A long stream of ``session``'s ``version``, sent and streaming: it holds a slot until closed."""
    older = await http.post(
        url + CHAT,
        json=chat_body(f"{session}, version {version}", stream=True, **HOLD),
        headers=session_headers(session, version),
    )
    assert older.status == 200
    await older.content.readuntil(b"\n\n")  # sent: it holds its slot
    return older


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any, Any]:
    async with http.post(url + CHAT, json=body, headers=headers) as r:
        return r.status, r.headers, orjson.loads(await r.read())


class SlotHolder:
    """Holds an admission slot with a stream it reads only its first chunk of."""

    def __init__(self, http: aiohttp.ClientSession, gateway: str) -> None:
        self.http, self.gateway = http, gateway
        self.response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> SlotHolder:
        self.response = await self.http.post(
            self.gateway + CHAT, json=chat_body("hold the slot", stream=True, **HOLD)
        )
        assert self.response.status == 200
        await self.response.content.readuntil(b"\n\n")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.response is not None
        self.response.close()


async def waiting(http: aiohttp.ClientSession, gateway: str, priority: Priority) -> float:
    return metric(await scrape(http, gateway), "gateway_admission_waiting", priority=priority)


# ---- supersede ---------------------------------------------------------------------------------------
async def test_a_newer_version_drops_the_older_one_from_the_queue(
    replica: str, http: aiohttp.ClientSession
) -> None:
    received = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    async with running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=PATIENT) as gw:
        async with SlotHolder(http, gw.url):
            older = asyncio.create_task(
                post(http, gw.url, chat_body("shopper 7, version 1", **SHORT), **session_headers("s7", 1))
            )
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "v1 waits")
            newer = asyncio.create_task(
                post(http, gw.url, chat_body("shopper 7, version 2", **SHORT), **session_headers("s7", 2))
            )
            status, headers, body = await older
            assert status == 409
            assert body["error"]["type"] == "superseded"
            assert headers["x-gateway-superseded-by"] == "2"
        status, _, _ = await newer  # the slot is free again
        assert status == 200
        # A late version 1 (a retry, a reordered sender) is superseded on arrival.
        status, headers, body = await post(
            http, gw.url, chat_body("shopper 7, version 1", **SHORT), **session_headers("s7", 1)
        )
        assert (status, body["error"]["type"], headers["x-gateway-superseded-by"]) == (409, "superseded", "2")
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_superseded_total", stage="queued") == 1
        assert metric(text, "gateway_superseded_total", stage="arrival") == 1
        assert metric(text, "gateway_cancelled_total") == 0
    # The replica saw the slot holder and version 2: version 1 never left the gateway.
    after = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    assert after - received == 2


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
async def test_a_newer_version_cancels_the_older_one_in_flight(
    replica: str, http: aiohttp.ClientSession, stream: bool
) -> None:
    before = await scrape(http, replica)
    received = metric(before, "sim_requests_total", endpoint="chat")
    finished_tokens = metric(before, "sim_completion_tokens_total")
    # Version 2 extends version 1's prompt, as a shopper's next prompt does (a history of its own, so
    # no other test's prompt shares its prefix).
    history = f"Shopper s8 ({uuid.uuid4().hex}). Activity: " + "viewed a lantern; " * 80
    async with running_gateway([replica], "round_robin") as gw:
        older = asyncio.create_task(
            http.post(
                gw.url + CHAT,
                json=chat_body(history, stream=stream, **LONG),
                headers=session_headers("s8", "3.1"),
            )
        )
        if stream:
            first = await older
            assert first.status == 200
            await first.content.readuntil(b"\n\n")
        else:
            await until(lambda: _at_least(_running(http, replica), 1), "version 1 runs at the replica")
        status, _, newer = await post(
            http,
            gw.url,
            chat_body(history + "added a lantern to cart", **SHORT),
            **session_headers("s8", "3.2"),
        )
        assert status == 200
        if stream:  # version 1's first token was out, so its prefill was done: its blocks stay cached
            usage = newer["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2
        answer = await older
        if stream:  # its status line was out: the stream ends with an error event saying what a 409 says
            last = (await answer.read()).rstrip().rsplit(b"\n\n", 1)[-1]
            error = orjson.loads(last.removeprefix(b"data: "))["error"]
            assert (error["type"], error["code"], error["superseded_by"]) == ("superseded", 409, "3.2")
        else:
            assert answer.status == 409
            assert orjson.loads(await answer.read())["error"]["type"] == "superseded"
            assert answer.headers["x-gateway-superseded-by"] == "3.2"
        answer.close()
        assert metric(await scrape(http, gw.url), "gateway_cancelled_total") == 1
        # The replica dropped version 1 unfinished (its connection was closed) and freed its slot: of
        # the two requests it received, only version 2's tokens were finished.
        await until(lambda: _equals(_running(http, replica), 0), "the replica's slot is free")
    after = await scrape(http, replica)
    assert metric(after, "sim_requests_total", endpoint="chat") - received == 2
    assert (
        metric(after, "sim_completion_tokens_total") - finished_tokens == newer["usage"]["completion_tokens"]
    )


async def test_a_client_whose_stream_is_superseded_hears_so_and_keeps_the_gateway(replica: str) -> None:
    """An ``LLMClient`` streaming through the gateway, its call superseded after its status line (a
    shopper's newer prompt from another process, as after a rebalance). The gateway cut the stream
    off, so the client saw a broken connection and ejected the gateway, its only endpoint: every
    other call of that process then waited for the next health check. The stream now ends with an
    error event the client reads as ``SupersededByNewer``, which counts against nobody."""
    history = f"Shopper s12 ({uuid.uuid4().hex}). Activity: " + "viewed a lantern; " * 80
    messages = [{"role": "user", "content": history}]
    async with running_gateway([replica], "round_robin") as gw:
        config = ClientConfig.model_validate({"endpoints": [gw.url], "stream": True})
        async with LLMClient(config) as client, aiohttp.ClientSession() as http:
            older = asyncio.create_task(
                client.chat(
                    messages,
                    routing_key="s12",
                    max_tokens=600,
                    extra_body={"ignore_eos": True},
                    session_version="5.1",
                )
            )
            await until(  # its first chunk written to the client: its status line is out
                lambda: _at_least(
                    _metric_of(http, gw.url, "gateway_time_to_first_byte_seconds_count", path=CHAT), 1
                ),
                "version 1 streams",
            )
            status, _, _ = await post(
                http,
                gw.url,
                chat_body(history + "added a lantern to cart", **SHORT),
                **session_headers("s12", "5.2"),
            )
            assert status == 200
            with pytest.raises(SupersededByNewer) as raised:
                await older
            assert raised.value.newer_version == "5.2"
            assert [e.healthy for e in client.endpoints] == [True], "the gateway was not ejected"
            assert [e.ejections for e in client.endpoints] == [0]
            # read as said, not as a malformed answer retried into the 409 (the client's decoder took
            # every error event for the wrong shape until 7 Dec 2026)
            assert [e.invalid_answers for e in client.endpoints] == [{}]
            assert raised.value.attempts == 1


# ---- overload, by priority ----------------------------------------------------------------------------
async def test_a_full_queue_refuses_lower_priorities_first(replica: str, http: aiohttp.ClientSession) -> None:
    async with running_gateway(
        [replica], "round_robin", per_replica_in_flight=1, max_waiting=2, max_wait_s=PATIENT
    ) as gw:
        async with SlotHolder(http, gw.url):

            def send(priority: str, text: str) -> asyncio.Task[tuple[int, Any, Any]]:
                return asyncio.create_task(
                    post(http, gw.url, chat_body(text, **SHORT), **{"x-priority": priority})
                )

            low = send("low", "low, first")
            await until(lambda: _equals(waiting(http, gw.url, "low"), 1), "low waits")
            normal = send("normal", "normal")
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "normal waits")
            # The queue is full (2): a high request pushes the low one out ...
            high = send("high", "high")
            status, headers, body = await low
            assert status == 429
            assert body["error"]["type"] == "overloaded"
            assert int(headers["Retry-After"]) >= 1
            # ... and a low request arriving to a queue of better ones is refused at once.
            status, headers, body = await post(
                http, gw.url, chat_body("low, second", **SHORT), **{"x-priority": "low"}
            )
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert not normal.done() and not high.done()
        assert (await high)[0] == 200 and (await normal)[0] == 200
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_refused_total", priority="low", reason="pushed_out") == 1
        assert metric(text, "gateway_refused_total", priority="low", reason="queue_full") == 1
        assert metric(text, "gateway_refused_total", priority="normal", reason="queue_full") == 0
        assert metric(text, "gateway_requests_total", path=CHAT, status="429") == 2


async def test_a_wait_past_its_bound_is_refused_with_retry_after(
    replica: str, http: aiohttp.ClientSession
) -> None:
    bounds = {"high": 60.0, "normal": 60.0, "low": 0.1}
    async with running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=bounds) as gw:
        async with SlotHolder(http, gw.url):
            status, headers, body = await post(
                http, gw.url, chat_body("browse pause", **SHORT), **{"x-priority": "low"}
            )
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert "waited" in body["error"]["message"]
        assert (
            metric(await scrape(http, gw.url), "gateway_refused_total", priority="low", reason="waited") == 1
        )
        status, _, body = await post(http, gw.url, chat_body("x", **SHORT), **{"x-priority": "urgent"})
        assert status == 400 and body["error"]["param"] == "x-priority"


async def test_a_predicted_wait_over_the_bound_is_refused_at_once(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """The gateway learns how long a slot is held; a low request that would wait longer than its bound
    is refused on arrival, while a high one with a longer bound queues and is served. ``Retry-After`` is
    the predicted wait rounded up to whole seconds: with only the slot holder ahead, one mean hold."""
    held_s = 2.5
    bounds = {"high": 60.0, "normal": 60.0, "low": held_s / 2}
    async with running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=bounds) as gw:
        started = time.monotonic()
        async with SlotHolder(http, gw.url):
            await asyncio.sleep(held_s)  # one slot held at least this long: the mean hold is learned
        async with SlotHolder(http, gw.url):
            # the first hold ended before this one got the only slot: it lasted held_s up to this
            longest_hold_s = time.monotonic() - started
            status, headers, body = await post(
                http, gw.url, chat_body("browse pause", **SHORT), **{"x-priority": "low"}
            )
            assert status == 429 and "would wait" in body["error"]["message"]
            retry_after = int(headers["Retry-After"])
            assert math.ceil(held_s) <= retry_after <= math.ceil(longest_hold_s), (
                retry_after,
                longest_hold_s,
            )
            high = asyncio.create_task(
                post(http, gw.url, chat_body("purchase", **SHORT), **{"x-priority": "high"})
            )
            await until(lambda: _equals(waiting(http, gw.url, "high"), 1), "high waits")
        assert (await high)[0] == 200
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_refused_total", priority="low", reason="predicted_wait") == 1
        assert metric(text, "gateway_refused_total", priority="high", reason="predicted_wait") == 0


async def test_a_newer_version_refused_at_once_leaves_the_older_one_queued(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """Admission decides on the newer version before it supersedes: refused at once (a low request
    whose predicted wait is past its bound), it had dropped the older one from the queue all the same,
    and the session got no answer at all. The older one now stays and is served."""
    held_s = 2.5
    bounds = {"high": 60.0, "normal": 60.0, "low": held_s / 2}
    async with running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=bounds) as gw:
        async with SlotHolder(http, gw.url):
            await asyncio.sleep(held_s)  # the mean hold is learned: at least held_s
        async with SlotHolder(http, gw.url):
            older = asyncio.create_task(
                post(http, gw.url, chat_body("shopper 7, version 1", **SHORT), **session_headers("s7", 1))
            )
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "v1 waits")
            newer = session_headers("s7", 2, **{"x-priority": "low"})
            status, _, body = await post(http, gw.url, chat_body("shopper 7, version 2", **SHORT), **newer)
            assert status == 429 and "would wait" in body["error"]["message"]
            assert await waiting(http, gw.url, "normal") == 1, "version 1 still waits"
        status, _, _ = await older  # the slot is free again
        assert status == 200
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_superseded_total", stage="queued") == 0
        assert metric(text, "gateway_refused_total", priority="low", reason="predicted_wait") == 1


async def test_a_newer_version_takes_the_slot_its_cancelled_older_one_frees(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """With the queue full, a newer version whose older one holds a slot is not refused as if the queue
    stayed full: the cancelled call's slot goes to the waiter ahead, and the newer one queues."""
    async with running_gateway(
        [replica], "round_robin", per_replica_in_flight=1, max_waiting=1, max_wait_s=PATIENT
    ) as gw:
        older = await holding_the_slot(http, gw.url, "s7", 1)
        other = asyncio.create_task(post(http, gw.url, chat_body("shopper 8", **SHORT)))
        await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "the queue is full")
        status, _, _ = await post(
            http, gw.url, chat_body("shopper 7, version 2", **SHORT), **session_headers("s7", 2)
        )
        assert status == 200
        assert (await other)[0] == 200
        older.close()
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_cancelled_total") == 1
        assert metric(text, "gateway_refused_total", priority="normal", reason="queue_full") == 0


async def test_a_high_priority_newer_version_takes_its_older_ones_slot_before_a_low_waiter(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """The slot a superseded call frees is the newer version's when no waiter of its class or better
    waits. The older call was cancelled before the newer one's wait was in the gate, so it handed its
    slot to the low-priority waiter already there: the high-priority newer version waited behind it (and
    with a short bound was refused, its older version cancelled: the session got no answer)."""
    bounds = {"high": 1.0, "normal": 60.0, "low": 60.0}
    async with running_gateway(
        [replica], "round_robin", per_replica_in_flight=1, max_waiting=1, max_wait_s=bounds
    ) as gw:
        older = await holding_the_slot(http, gw.url, "s7", 1)
        low = asyncio.create_task(
            post(http, gw.url, chat_body("a low-priority shopper", **HOLD), **{"x-priority": "low"})
        )
        await until(lambda: _equals(waiting(http, gw.url, "low"), 1), "the low one waits")
        status, _, body = await post(
            http,
            gw.url,
            chat_body("shopper 7, version 2", **SHORT),
            **session_headers("s7", 2, **{"x-priority": "high"}),
        )
        assert status == 200, body
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_cancelled_total") == 1
        older.close()
        low.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await low


async def test_a_queued_caller_that_leaves_is_never_sent(replica: str, http: aiohttp.ClientSession) -> None:
    received = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    async with (
        running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=PATIENT) as gw,
        SlotHolder(http, gw.url),
    ):
        async with aiohttp.ClientSession() as leaving:
            queued = asyncio.create_task(post(leaving, gw.url, chat_body("nobody waits", **SHORT)))
            await until(lambda: _equals(waiting(http, gw.url, "normal"), 1), "it waits")
            queued.cancel()  # the caller gives up: its connection closes
        await until(lambda: _equals(waiting(http, gw.url, "normal"), 0), "it leaves the queue")
        # Read while the slot holder still holds its stream: its own close, later, is a caller gone
        # mid-stream and would race this count.
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_requests_total", path=CHAT, status="caller_gone") == 1
    # Only the slot holder reached the replica.
    assert metric(await scrape(http, replica), "sim_requests_total", endpoint="chat") - received == 1


# ---- never pay twice --------------------------------------------------------------------------------
CALLER = """
import asyncio, sys, aiohttp
async def main():
    async with aiohttp.ClientSession() as http:
        async with http.post(sys.argv[1], data=sys.argv[2], headers={
            "content-type": "application/json", "idempotency-key": sys.argv[3]}) as r:
            await r.read()
asyncio.run(main())
"""


async def test_a_killed_callers_call_finishes_and_its_repeat_joins_or_reuses_it(
    replica: str, http: aiohttp.ClientSession
) -> None:
    before = await scrape(http, replica)
    received = metric(before, "sim_requests_total", endpoint="chat")
    aborted = metric(before, "sim_request_errors_total", reason="aborted")
    body = chat_body("shopper 9: viewed boots; added boots to cart", **LONG)
    async with running_gateway([replica], "round_robin") as gw:
        caller = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CALLER, gw.url + CHAT, orjson.dumps(body).decode(), "s9:0:4", cwd=REPO_ROOT
        )
        await until(lambda: _at_least(_running(http, replica), 1), "the call runs at the replica")
        os.kill(caller.pid, signal.SIGKILL)  # as the runner dies: its connection closes mid-call
        await caller.wait()
        # The restarted caller sends the same call again: it joins the one in flight (or reuses its
        # answer, had it ended meanwhile).
        async with http.post(gw.url + CHAT, json=body, headers={"Idempotency-Key": "s9:0:4"}) as r:
            assert r.status == 200
            assert r.headers["x-gateway-idempotent"] in ("joined", "reused")
            first = await r.read()
        async with http.post(gw.url + CHAT, json=body, headers={"Idempotency-Key": "s9:0:4"}) as r:
            assert (r.status, r.headers["x-gateway-idempotent"]) == (200, "reused")
            assert await r.read() == first
        # The same key with another request is the caller's bug, not a repeat; so is the same body
        # under another session or version (it would skip the session's supersede check).
        other = chat_body("another prompt", **SHORT)
        async with http.post(gw.url + CHAT, json=other, headers={"Idempotency-Key": "s9:0:4"}) as r:
            assert r.status == 422
        for version in ("1", "2"):
            headers = {"Idempotency-Key": "s9:0:4", **session_headers("s9", version)}
            async with http.post(gw.url + CHAT, json=body, headers=headers) as r:
                assert r.status == 422, version
        # ... and under another session without a version (it was answered with this call's answer,
        # made on the first session's replica)
        unversioned = {"Idempotency-Key": "s9:0:4", "x-session-id": "s-other"}
        async with http.post(gw.url + CHAT, json=body, headers=unversioned) as r:
            assert r.status == 422
        text = await scrape(http, gw.url)
        assert (
            metric(text, "gateway_idempotent_total", outcome="joined")
            + metric(text, "gateway_idempotent_total", outcome="reused")
            == 2
        )
    after = await scrape(http, replica)
    assert metric(after, "sim_requests_total", endpoint="chat") - received == 1  # paid once
    assert metric(after, "sim_request_errors_total", reason="aborted") == aborted  # never aborted


async def test_concurrent_streams_with_one_key_share_one_call(
    replica: str, http: aiohttp.ClientSession
) -> None:
    received = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    body = chat_body("shopper 10: viewed a tent", stream=True, max_tokens=40, ignore_eos=True)

    async def call() -> tuple[str | None, bytes]:
        async with http.post(gw.url + CHAT, json=body, headers={"Idempotency-Key": "s10:0:1"}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            return r.headers.get("x-gateway-idempotent"), await r.read()

    async with running_gateway([replica], "round_robin") as gw:
        answers = await asyncio.gather(*(call() for _ in range(3)))
    notes = [note for note, _ in answers]
    assert notes.count(None) == 1  # one call; the others joined it (or reused it, had it ended)
    assert all(note in (None, "joined", "reused") for note in notes)
    assert len({stream for _, stream in answers}) == 1  # every caller got the whole stream, byte for byte
    assert answers[0][1].rstrip().endswith(b"data: [DONE]")
    assert metric(await scrape(http, replica), "sim_requests_total", endpoint="chat") - received == 1


async def test_llm_client_chat_sends_its_idempotency_key(replica: str, http: aiohttp.ClientSession) -> None:
    """``LLMClient.chat(idempotency_key=...)`` through the gateway: two calls of one prompt, one request."""
    received = metric(await scrape(http, replica), "sim_requests_total", endpoint="chat")
    messages = [{"role": "user", "content": "shopper 11: bought a lamp"}]
    async with running_gateway([replica], "round_robin") as gw:
        config = ClientConfig.model_validate({"endpoints": [gw.url], "stream": False})
        async with LLMClient(config) as client:
            answers = await asyncio.gather(
                *(
                    client.chat(messages, routing_key="s11", max_tokens=30, idempotency_key="s11:0:2")
                    for _ in range(2)
                )
            )
    assert answers[0].text == answers[1].text
    assert metric(await scrape(http, replica), "sim_requests_total", endpoint="chat") - received == 1


# ---- helpers ----------------------------------------------------------------------------------------
async def _metric_of(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    return metric(await scrape(http, url), name, **labels)


async def _aborted(http: aiohttp.ClientSession, replica: str) -> float:
    return await _metric_of(http, replica, "sim_request_errors_total", reason="aborted")


async def _running(http: aiohttp.ClientSession, replica: str) -> float:
    return await _metric_of(http, replica, "sim_num_requests_running")


async def _equals(value: Awaitable[float], wanted: float) -> bool:
    return await value == wanted


async def _at_least(value: Awaitable[float], wanted: float) -> bool:
    return await value >= wanted


async def test_a_gateway_behind_a_gateway_passes_its_refusal_on_as_429(
    replica: str, http: aiohttp.ClientSession
) -> None:
    """A gateway whose replicas refuse for load (429 with ``Retry-After``; here another gateway, its
    one slot held) answers 429 ``overloaded`` with ``Retry-After`` too: it answered 502, which a client
    in front counts as the gateway failing (two in a row eject it), and the ``Retry-After`` was lost."""
    bounds = {"high": 0.1, "normal": 0.1, "low": 0.1}
    # The inner gateway asks for at least 1 s. The first outer gateway's deadline leaves less (refused
    # at once); the second has time to wait, but no retry budget (spent on the refusals).
    no_budget = {"retry": {"max_attempts": 3, "backoff_base_s": 0.01, "budget_min_tokens": 0}}
    async with (
        running_gateway([replica], "round_robin", per_replica_in_flight=1, max_wait_s=bounds) as inner,
        running_gateway([inner.url], "round_robin", deadline_s=0.5) as outer,
        running_gateway([inner.url], "round_robin", client=no_budget, deadline_s=20) as spent,
    ):
        async with SlotHolder(http, inner.url):
            for gateway in (outer, outer, outer, spent, spent):  # a refusal ejects nothing: again alike
                status, headers, body = await post(http, gateway.url, chat_body("cart add", **SHORT))
                assert status == 429, body
                assert body["error"]["type"] == "overloaded"
                assert int(headers["Retry-After"]) >= 1
        assert (await post(http, outer.url, chat_body("cart add", **SHORT)))[0] == 200
        text = await scrape(http, outer.url)
        assert metric(text, "gateway_requests_total", path=CHAT, status="429") == 3


async def test_what_admission_lets_through_is_sent_at_once_whatever_the_clients_own_limit(
    http: aiohttp.ClientSession,
) -> None:
    """The gateway's admission is the in-flight limit. The client inside it has a limit of its own
    (``LLM_MAX_IN_FLIGHT``, 256 by default), which with five or more replicas (64 each) was the lower:
    what admission let through then waited in the client's first-in-first-out queue, where priority,
    the wait bounds and supersede no longer applied and no gauge showed it. The client's limit is now
    raised to admission's ceiling. Here the client's is 1 and admission's 3: all three reach the replica
    together."""
    arrived: list[str] = []
    all_in = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        arrived.append((await request.json())["messages"][0]["content"])
        if len(arrived) == 3:
            all_in.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), 5)  # released together, or after the bound
        return web.json_response(
            {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "concurrent": all_in.is_set(),
            }
        )

    async with (
        replica_answering(chat) as url,
        running_gateway([url], "round_robin", client={"max_in_flight": 1}, max_in_flight=3) as gw,
    ):

        async def post(i: int) -> Any:
            async with http.post(gw.url + CHAT, json=chat_body(f"call {i}", max_tokens=4)) as r:
                assert r.status == 200
                return await r.json()

        answers = await asyncio.gather(*(post(i) for i in range(3)))
    assert [answer["concurrent"] for answer in answers] == [True, True, True], "one at a time"
    assert gw.client.config.max_in_flight == 3
