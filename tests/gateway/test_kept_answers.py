"""What the gateway keeps for a repeated ``Idempotency-Key``, over real HTTP: simulator replicas (one
of them sending a bad 200, the simulator's ``bad_answer`` fault) behind a gateway in the test's loop.

A broken 2xx answer (an HTML page, a stream with an ``error`` event) reaches its caller as it came, but
it is judged once, as the fleet judges it: not kept for the key's failover retry, and counted as a bad
answer, so a replica sending them is quarantined. An empty key is no key.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from llm_client.answer_health import AnswerHealthSettings
from serving.simulator.bad_answers import BadAnswer
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import (
    _flights_left_once_idle,
    _live_flights,
    chat_body,
    key_for,
    metric,
    replica_streaming,
    running_gateway,
    scrape,
    sid,
)
from tests.helpers import collector_off

CHAT = "/v1/chat/completions"
HEALTH = AnswerHealthSettings(window=10, min_invalid=3, invalid_share=0.5, cooldown_s=60)
"""Three bad answers in a window of ten quarantine; no probe comes back within a test."""


async def test_a_broken_200_is_not_kept_for_its_key_and_quarantines_its_replica(
    http: aiohttp.ClientSession,
) -> None:
    """A replica answering an HTML page with a 200: the answer was kept for its key, so the caller's
    failover retry got the same page back (``reused``) for the whole TTL, and it counted as a good
    answer, so the replica was never quarantined."""
    async with (
        running_simulator(time_scale=0.0, bad_answer="not_json") as bad,
        running_simulator(time_scale=0.0) as good,
        running_gateway(
            [bad.url, good.url], "session_affinity", client={"answer_health": HEALTH.model_dump()}
        ) as gw,
    ):
        shopper = key_for(bad.url, [bad.url, good.url])
        broken = gw.client.endpoints[0]
        keyed = {**sid(shopper), "Idempotency-Key": "job:shopper:1"}
        body = chat_body("hi there", max_tokens=5)
        with collector_off():
            before = _live_flights()
            for _ in range(2):  # the caller's retry sends the same key again
                async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
                    assert (r.status, r.content_type) == (200, "text/html"), "passed on as it came"
                    assert r.headers["x-gateway-replica"] == broken.name
                    assert "x-gateway-idempotent" not in r.headers, "a broken answer is not reused"
                    assert b"<html>" in await r.read()
            assert await _flights_left_once_idle(gw, before) == [], "nothing kept, nothing in a cycle"
        assert not broken.quarantined, "two bad answers are under min_invalid"
        async with http.post(gw.url + CHAT, json=body, headers=sid(shopper)) as r:
            assert r.headers["x-gateway-replica"] == broken.name
            await r.read()
        assert broken.quarantined, "the third bad answer in its window quarantines it"
        async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
            assert r.status == 200 and r.headers["x-gateway-replica"] != broken.name
            assert orjson.loads(await r.read())["choices"], "the retry is answered by the healthy replica"
        text = await scrape(http, gw.url)
    assert metric(text, "gateway_idempotent_total", outcome="reused") == 0
    assert metric(text, "gateway_replica_invalid_answers_total", replica=broken.name, kind="not_json") == 3
    assert metric(text, "gateway_replica_state", replica=broken.name, state="quarantined_not_json") == 1


async def test_a_stream_with_an_error_event_is_not_kept_for_its_key(http: aiohttp.ClientSession) -> None:
    """A 200 stream carrying an ``error`` event (a replica that failed mid-generation and said so) was
    kept for its key like a whole answer: every repeat got the error back without a call. A replica of
    the test's own: the simulator has no fault that sends an error event inside a stream."""
    error = {"error": {"message": "engine ran out of KV blocks", "type": "InternalServerError"}}
    failing_stream = b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"
    async with (
        replica_streaming(failing_stream) as (url, calls),
        running_gateway([url], "round_robin") as gw,
    ):
        keyed = {"Idempotency-Key": "job:shopper:2"}
        body = chat_body("hi there", max_tokens=5, stream=True)
        for _ in range(2):
            async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
                assert r.status == 200 and "x-gateway-idempotent" not in r.headers
                assert b'"error"' in await r.read(), "passed on as it came"
        text = await scrape(http, gw.url)
    assert len(calls) == 2, "the repeat called again"
    assert metric(text, "gateway_idempotent_total", outcome="reused") == 0


@pytest.mark.parametrize("bad", ["wrong_types", "too_deep"])
async def test_a_stream_of_the_wrong_shape_is_not_kept_and_counts_as_a_bad_answer(
    http: aiohttp.ClientSession, bad: BadAnswer
) -> None:
    """A 200 stream whose events are not completion chunks (content a number; a field nested past any
    decoder) counted as a good answer and was kept for its key: the in-process client behind the
    gateway refused it (``InvalidAnswer``), and its failover retry with the same key got the same bytes
    back, ``reused``, for the whole TTL. Now it is judged as ``read_stream`` judges it."""
    async with (
        running_simulator(time_scale=0.0, bad_answer=bad) as replica,
        running_gateway([replica.url], "round_robin") as gw,
    ):
        keyed = {"Idempotency-Key": f"job:shopper:{bad}"}
        body = chat_body("hi there", max_tokens=5, stream=True)
        for _ in range(2):
            async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
                assert r.status == 200 and "x-gateway-idempotent" not in r.headers
                await r.read()  # passed on as it came
        text = await scrape(http, gw.url)
        received = metric(await scrape(http, replica.url), "sim_request_errors_total", reason="bad_answer")
    assert received == 2, "the repeat called again"
    assert metric(text, "gateway_idempotent_total", outcome="reused") == 0
    replica_name = gw.client.endpoints[0].name
    assert (
        metric(text, "gateway_replica_invalid_answers_total", replica=replica_name, kind="wrong_shape") == 2
    )


@pytest.mark.parametrize(
    ("events", "invalid"),
    [(b"data: [DONE]\n\n", 2), (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', 0)],
    ids=["no_event", "no_done"],
)
async def test_a_stream_with_no_event_or_no_done_is_not_kept(
    http: aiohttp.ClientSession, events: bytes, invalid: int
) -> None:
    """A stream that held no completion chunk is a bad answer (``empty``), as ``read_stream`` judges
    it; one that ended cleanly without ``[DONE]`` may be short: passed on and not counted against the
    replica, but not kept for its key either. Both were kept."""
    async with replica_streaming(events) as (url, calls), running_gateway([url], "round_robin") as gw:
        keyed = {"Idempotency-Key": "job:shopper:short"}
        body = chat_body("hi there", max_tokens=5, stream=True)
        for _ in range(2):
            async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
                assert r.status == 200 and "x-gateway-idempotent" not in r.headers
                assert await r.read() == events, "passed on as it came"
        text = await scrape(http, gw.url)
        replica_name = gw.client.endpoints[0].name
    assert len(calls) == 2, "the repeat called again"
    assert metric(text, "gateway_idempotent_total", outcome="reused") == 0
    assert (
        metric(text, "gateway_replica_invalid_answers_total", replica=replica_name, kind="empty") == invalid
    )


async def test_a_stream_whose_done_has_no_line_end_is_kept(http: aiohttp.ClientSession) -> None:
    """``data: [DONE]`` as the body's last bytes, without a line end, still ends the stream whole: it
    is kept for its key, and the repeat reuses it."""
    events = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]'
    async with replica_streaming(events) as (url, calls), running_gateway([url], "round_robin") as gw:
        keyed = {"Idempotency-Key": "job:shopper:done-at-eof"}
        body = chat_body("hi there", max_tokens=5, stream=True)
        notes = []
        for _ in range(2):
            async with http.post(gw.url + CHAT, json=body, headers=keyed) as r:
                assert r.status == 200 and await r.read() == events
                notes.append(r.headers.get("x-gateway-idempotent"))
    assert notes == [None, "reused"] and len(calls) == 1


@pytest.mark.parametrize("empty", ["", "   "], ids=["empty", "whitespace"])
async def test_an_empty_idempotency_key_is_no_key(http: aiohttp.ClientSession, empty: str) -> None:
    """Every caller sending an empty key shared one key: another body under it was refused (422), and
    the same body got another caller's answer."""
    async with (
        running_simulator(time_scale=0.0) as replica,
        running_gateway([replica.url], "round_robin") as gw,
    ):
        for content in ("body A", "body B", "body A"):
            body = chat_body(content, max_tokens=5)
            async with http.post(gw.url + CHAT, json=body, headers={"Idempotency-Key": empty}) as r:
                assert r.status == 200, await r.text()
                assert "x-gateway-idempotent" not in r.headers
                assert orjson.loads(await r.read())["choices"]
        text = await scrape(http, gw.url)
    assert metric(text, "gateway_requests_total", path=CHAT, status="422") == 0
