"""The real-time service over HTTP against the real parts: simulator replicas, Redis; and its clients."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from batch.signals import ProductSignalWriter
from devstack.processes import free_port
from devstack.stack import StackState
from prompt_assembly.records import ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding
from realtime.client import MatchClient, MatchRejected, MatchUnavailable, SyncMatchClient
from realtime.config import RealtimeSettings
from realtime.models import MatchRequest
from realtime.openapi import SPEC_PATH, openapi_spec
from realtime.service import LoopLag, create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated
from tests.helpers import collector_off, serving
from tests.realtime.service_kit import realtime_service

CANDIDATES: list[dict[str, Any]] = [
    {"product_id": "KID-witch", "title": "Witch Costume Set"},
    {"product_id": "MAK-paint", "title": "Glow Face Paint Palette"},
    {"product_id": "OUT-spider", "title": "Giant Spider Yard Decoration", "score": 0.9},
]


async def _write_signals(isolated: Isolated, redis_client: Any) -> None:
    """Shopper and product signals, through the writers the pipelines use."""
    sink = RedisSignalSink(isolated.sinks(), client=redis_client)
    understanding = ShopperUnderstanding(
        interests=["kids witch costumes", "face paint"],
        occasion="school parade",
        style="fun",
        price_sensitivity="medium",
        summary="Parent assembling a witch look for a school parade.",
    )
    await sink.write(
        [
            ShopperInsight(
                request_id="s1:1",
                shopper_id="s1",
                seq=1,
                reason="add_to_cart",
                understanding=understanding,
                text="t",
                model="m",
                replica="r",
                usage=Usage(),
                event_count=3,
                last_event_ts=time.time(),
                ttft_ms=1,
                latency_ms=1,
                attempts=1,
                produced_at=time.time(),
            )
        ]
    )
    rows = []
    for pid, title, segment in [("KID-witch", "Witch Costume Set", "parents of kids")]:
        body = {
            "product_id": pid, "title": title, "model": "m", "parts": 1, "usage": {},
            "understanding": {"segments": [segment], "occasions": ["school parade"], "style": "fun",
                              "price_tier": "mid", "summary": "A kids witch costume."},
        }  # fmt: skip
        rows.append({"custom_id": pid, "line": 0, "response": {"status_code": 200, "body": body}})
    await ProductSignalWriter(redis_client, isolated.prefix, 60).write("job-test", rows)


async def _direct_call_ms(url: str) -> float:
    """One chat call straight to a replica, as the service would make it (no deadline)."""
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        body = {"model": "any", "messages": [{"role": "user", "content": "rank these"}], "max_tokens": 200}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.read()
    return (time.perf_counter() - started) * 1000


async def _post(client: TestClient[Any, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    started = time.perf_counter()
    response = await client.post("/v1/match", json=body)
    data = await response.json()
    return response.status, data, (time.perf_counter() - started) * 1000


@pytest.mark.parametrize("signal_reads", ["script", "pipeline"])
async def test_ranks_with_the_model_using_both_signals(
    stack: StackState, isolated: Isolated, redis_client: Any, signal_reads: str
) -> None:
    await _write_signals(isolated, redis_client)
    service = realtime_service(isolated, stack.llm_endpoints, stack.model, signal_reads=signal_reads)
    async with service as client:
        status, body, _ = await _post(
            client, {"shopper_id": "s1", "query": "witch", "candidates": CANDIDATES, "deadline_ms": 3000}
        )
        assert status == 200, body
        assert body["degraded"] is False and body["degraded_reason"] is None
        assert body["signals"] == {"shopper": True, "products": 1}
        assert sorted(r["product_id"] for r in body["ranked"]) == sorted(c["product_id"] for c in CANDIDATES)
        assert [r["rank"] for r in body["ranked"]] == [1, 2, 3]
        assert body["ranked"][0]["source"] == "llm" and all(r["reason"] for r in body["ranked"])
        assert 0 < body["llm_ms"] <= body["elapsed_ms"] < 3000

        health = await (await client.get("/health")).json()
        assert health == {"status": "ok", "llm_replicas": 3, "llm_routable": 3, "redis": "ok"}
        metrics = await (await client.get("/metrics")).text()
        assert 'realtime_requests_total{outcome="llm"} 1.0' in metrics
        assert "realtime_overhead_seconds_bucket" in metrics


async def test_model_missing_the_deadline_gets_the_fallback_in_time(
    isolated: Isolated, redis_client: Any
) -> None:
    await _write_signals(isolated, redis_client)
    async with running_simulator(time_scale=0.3) as slow, realtime_service(isolated, [slow.url]) as client:
        model_ms = await _direct_call_ms(slow.url)  # what waiting for the model would have cost
        # A first request opens the service's Redis connection, which a 150 ms deadline's share of
        # the signal read (40 ms at most) may not cover on a busy host.
        await _post(client, {"shopper_id": "s1", "candidates": CANDIDATES, "deadline_ms": 3000})
        for deadline_ms in (150, 300):
            request = {"shopper_id": "s1", "query": "", "candidates": CANDIDATES, "deadline_ms": deadline_ms}
            for _ in range(10):  # a busy host's loop lag can refuse one (429) or skip the model, by design
                status, body, took_ms = await _post(client, request)
                if status != 429 and body.get("llm_ms") is not None:
                    break
                await asyncio.sleep(0.2)
            assert status == 200, body
            assert body["degraded"] is True and body["degraded_reason"] == "deadline"
            assert body["llm_ms"] < model_ms and took_ms < model_ms, (
                "gave up on the model, did not wait it out"
            )
            assert body["ranked"][0] == {
                "product_id": "KID-witch", "rank": 1, "score": body["ranked"][0]["score"],
                "reason": "matches your interest in kids witch costumes", "source": "fallback",
            }  # fmt: skip


async def _post_until_the_model_is_cut(client: TestClient[Any, Any], request: dict[str, Any]) -> None:
    """``request`` until an answer whose model call was cut at its deadline: a busy host's loop lag can
    refuse one (429) or skip the model (no ``llm_ms``)."""
    for _ in range(10):
        status, body, _ = await _post(client, request)
        if status == 200 and body["llm_ms"] is not None:
            break
        await asyncio.sleep(0.2)
    assert status == 200 and body["degraded_reason"] == "deadline" and body["llm_ms"] is not None, body


async def test_a_model_call_cut_at_its_deadline_is_read_to_its_end_and_its_connection_kept(
    isolated: Isolated, redis_client: Any
) -> None:
    # The answer goes out at the deadline (the fallback); the model call reads on within the latency
    # pool's grace (llm_pool.CUT_GRACE_S), so the replica finishes it (it would compute a call this
    # short to its end anyway) and its connection serves the next call instead of being closed.
    await _write_signals(isolated, redis_client)
    async with running_simulator(time_scale=0.15) as sim, realtime_service(isolated, [sim.url]) as client:
        request = {"shopper_id": "s1", "query": "", "candidates": CANDIDATES, "deadline_ms": 3000}
        status, body, _ = await _post(client, request)  # the model's time for this call, uncut
        assert status == 200 and body["degraded"] is False, body
        model_ms = body["llm_ms"]
        request["deadline_ms"] = max(40, int(model_ms * 0.75))  # cut shortly before its end
        await asyncio.sleep(0.2)  # past the start-up's loop lag, which admission counts
        await _post_until_the_model_is_cut(client, request)
        kept = 'realtime_llm_cut_calls_total{outcome="kept"} 1.0'
        for _ in range(50):
            metrics = await (await client.get("/metrics")).text()
            if kept in metrics:
                break
            await asyncio.sleep(0.05)
        assert kept in metrics, [line for line in metrics.splitlines() if "cut_calls" in line]
        replica = await (await client.session.get(f"{sim.url}/metrics")).text()
        assert 'reason="aborted"' not in replica, "the replica saw the call's client go away"


async def test_a_request_whose_model_call_is_cut_leaves_nothing_for_the_collector(
    isolated: Isolated, redis_client: Any
) -> None:
    # Under overload most model calls are cut at the deadline; each one left the whole request (its
    # candidates, the fallback's rankings, the aiohttp call) in a reference cycle, and the service's
    # collections took 5-10 ms (docs/realtime.md, "1 Dec 2026").
    await _write_signals(isolated, redis_client)
    async with running_simulator(time_scale=0.3) as slow, realtime_service(isolated, [slow.url]) as client:
        request = {"shopper_id": "s1", "query": "", "candidates": CANDIDATES, "deadline_ms": 300}
        await _post(client, request)  # warm: connections, the model-time window
        await asyncio.sleep(0.2)  # past the start-up's loop lag, which admission counts
        with collector_off():
            await _post_until_the_model_is_cut(client, request)
            left = [o for o in gc.get_objects() if isinstance(o, MatchRequest)]
            assert left == [], "a cut request is kept alive by a reference cycle"


async def test_pool_down_answers_at_once_and_sheds_beyond_capacity(isolated: Isolated) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with realtime_service(isolated, [dead]) as client:
        # The first call finds the replica refusing connections (it is ejected, and the client waits
        # for re-admission up to the deadline); later calls see an empty pool and answer at once.
        took: list[float] = []
        for i in range(3):
            status, body, took_ms = await _post(client, {"shopper_id": "s9", "candidates": ["a", "b"]})
            assert status == 200 and body["degraded"] is True
            took.append(took_ms)
            if i > 0:  # no wait for a replica: nothing is left to wait for
                assert body["degraded_reason"] == "llm_unavailable" and body["llm_ms"] is None
        assert max(took[1:]) < took[0], f"later calls answered at once, the first waited: {took}"
        assert body["signals"] == {"shopper": False, "products": 0}
        assert (await (await client.get("/health")).json())["llm_routable"] == 0

    async with (
        running_simulator(time_scale=0.3) as slow,
        realtime_service(isolated, [slow.url], llm_concurrency_per_replica=2) as client,
    ):
        answers = await asyncio.gather(
            *(
                _post(client, {"shopper_id": f"s{i}", "candidates": ["a"], "deadline_ms": 200})
                for i in range(6)
            )
        )
        reasons = sorted(body["degraded_reason"] for _, body, _ in answers)
        assert reasons.count("overloaded") == 4 and reasons.count("deadline") == 2


@pytest.mark.parametrize(
    ("send", "status", "error_type"),
    [
        ({"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "invalid_json"),
        ({"json": {"shopper_id": "s", "candidates": []}}, 422, "validation_error"),
        ({"json": {"shopper_id": "s", "candidates": ["a"], "extra": 1}}, 422, "validation_error"),
        # a deadline admission would not read (it takes a JSON integer only): one deadline for both
        ({"json": {"shopper_id": "s", "candidates": ["a"], "deadline_ms": "50"}}, 422, "validation_error"),
        ({"json": {"shopper_id": "s", "candidates": ["a"], "deadline_ms": 50.0}}, 422, "validation_error"),
        ({"data": b"shopper=s", "headers": {"Content-Type": "text/plain"}}, 415, "unsupported_media_type"),
        ({"data": b"x" * 300_000, "headers": {"Content-Type": "application/json"}}, 413, "payload_too_large"),
    ],
)
async def test_bad_requests_get_clear_4xx(
    stack: StackState, isolated: Isolated, send: dict[str, Any], status: int, error_type: str
) -> None:
    async with realtime_service(isolated, stack.llm_endpoints) as client:
        response = await client.post("/v1/match", **send)
        body = await response.json()
        assert response.status == status
        assert body["error"]["type"] == error_type and body["error"]["message"]
        if status == 422:
            assert body["error"]["details"][0]["loc"] in ("candidates", "extra", "deadline_ms")
        missing = await client.get("/v1/nothing")
        assert missing.status == 404 and (await missing.json())["error"]["type"] == "not_found"


async def test_openapi_is_served_and_checked_in(stack: StackState, isolated: Isolated) -> None:
    assert json.loads(SPEC_PATH.read_text()) == openapi_spec(), "run: shopper realtime openapi --write"
    async with realtime_service(isolated, stack.llm_endpoints) as client:
        served = await (await client.get("/openapi.json")).json()
    assert served == openapi_spec()
    assert set(served["paths"]) == {"/v1/match", "/health", "/metrics"}


async def test_async_and_sync_clients(stack: StackState, isolated: Isolated, redis_client: Any) -> None:
    await _write_signals(isolated, redis_client)
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{next(a[1] for a in runner.addresses if isinstance(a, tuple))}"
    try:
        async with MatchClient(url) as client:
            answer = await client.match("s1", "witch", CANDIDATES, deadline_ms=3000)
            assert answer.degraded is False and len(answer.ranked) == 3
            with pytest.raises(MatchRejected) as rejected:
                await client.match("s1", "q", [])
            assert rejected.value.status == 422 and rejected.value.error is not None
            assert rejected.value.error.error.details[0].loc == "candidates"

        def blocking() -> tuple[Any, Any]:
            with SyncMatchClient(url) as sync_client:
                first = sync_client.match("s1", "", ["KID-witch", "MAK-paint"], deadline_ms=3000)
                second = sync_client.match("s1", "", ["KID-witch"], deadline_ms=250)  # same connection
                return first, second

        first, second = await asyncio.to_thread(blocking)
        assert first.ranked[0].product_id in ("KID-witch", "MAK-paint")
        assert second.deadline_ms == 250 and len(second.ranked) == 1
    finally:
        await runner.cleanup()
    with pytest.raises(MatchUnavailable):
        await asyncio.to_thread(SyncMatchClient(url).match, "s1", "", ["a"])
    async with MatchClient(url) as client:
        with pytest.raises(MatchUnavailable):
            await client.match("s1", "", ["a"])


async def test_loop_lag_is_measured_so_a_busy_host_answers_earlier() -> None:
    lag = LoopLag(interval_s=0.005)
    lag.start()
    await asyncio.sleep(0.03)
    time.sleep(0.08)  # noqa: ASYNC251 - the loop is blocked on purpose, as on a CPU-starved host
    await asyncio.sleep(0.03)
    assert lag.recent_s >= 0.07
    await lag.stop()


def _chat(content: Any, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": content}}], **fields}


_RANKING = '{"ranking": [{"product_id": "KID-witch", "reason": "fits"}]}'

UNUSABLE = {
    # The model's text is JSON of the wrong shape or types.
    "scores instead of ranking": _chat('{"scores": "high"}'),
    "a list where the object belongs": _chat('[{"product_id": "KID-witch", "reason": "x"}]'),
    "ranking is a string": _chat('{"ranking": "high"}'),
    "ranking is an object": _chat('{"ranking": {"product_id": "KID-witch"}}'),
    "an item is a list": _chat('{"ranking": [["KID-witch", "fits"]]}'),
    "product_id is a number": _chat('{"ranking": [{"product_id": 7, "reason": "fits"}]}'),
    "reason is an object": _chat('{"ranking": [{"product_id": "KID-witch", "reason": {"a": 1}}]}'),
    # The replica's envelope has no text where the answer belongs.
    "content is a number": _chat(42),
    "content is an object": _chat({"ranking": []}),
    "choices is a string": {"choices": "high"},
    "a choice is a string": {"choices": ["high"]},
}
"""Answers with no usable ranking: the fallback goes out, degraded."""

ODD_METADATA = {
    "model is a number": _chat(_RANKING, model=7),
    "usage is a string": _chat(_RANKING, usage="lots"),
    "usage counts are words": _chat(_RANKING, usage={"prompt_tokens": "many"}),
    "timings is a number": _chat(_RANKING, timings=3),
}
"""A usable ranking in an envelope with wrong-typed bookkeeping: the ranking may be used or not (the
client decides whether such an answer is valid), but the answer is a 200 either way."""


@asynccontextmanager
async def _misbehaving_replica(
    answer: Any, status: int = 200, headers: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """A replica that answers every chat call ``status`` with ``answer`` (and says it is healthy)."""

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(answer, status=status, headers=headers)

    async def healthy(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", healthy)
    app.router.add_get("/v1/models", healthy)
    async with serving(app) as url:
        yield url


@pytest.mark.parametrize(
    ("answer", "usable"),
    [*((a, False) for a in UNUSABLE.values()), *((a, True) for a in ODD_METADATA.values())],
    ids=[*UNUSABLE, *ODD_METADATA],
)
async def test_wrong_typed_answers_get_the_fallback_not_a_500(
    isolated: Isolated, redis_client: Any, answer: Any, usable: bool
) -> None:
    await _write_signals(isolated, redis_client)
    async with _misbehaving_replica(answer) as url, realtime_service(isolated, [url]) as client:
        for _ in range(2):  # the second call also finds the service (and the replica) usable
            response = await client.post(
                "/v1/match", json={"shopper_id": "s1", "candidates": CANDIDATES, "deadline_ms": 2000}
            )
            assert response.status == 200, await response.text()
            assert response.content_type == "application/json"
            body = await response.json()
            assert body["ranked"][0]["product_id"] == "KID-witch"
            assert body["model"] is None or isinstance(body["model"], str)
            if usable and not body["degraded"]:
                assert body["ranked"][0] == {
                    "product_id": "KID-witch", "rank": 1, "score": 1.0, "reason": "fits", "source": "llm"
                }  # fmt: skip
                continue
            assert body["degraded"] is True, body
            assert body["degraded_reason"] in ("invalid_answer", "llm_unavailable", "llm_error")
            assert all(r["source"] == "fallback" for r in body["ranked"])
        metrics = await (await client.get("/metrics")).text()
        assert "realtime_requests_total" in metrics


async def test_a_refusal_with_an_unreadable_retry_after_gets_the_fallback_not_a_500(
    isolated: Isolated, redis_client: Any
) -> None:
    """A replica refusing with a ``Retry-After`` date past any year: reading it raised OverflowError,
    which no handler on the way took for an LLM error, so the request was a 500 and the replica was
    never counted as failing. Unreadable, the header is ignored (the client's own backoff applies)."""
    await _write_signals(isolated, redis_client)
    refusal = {"error": {"message": "busy", "type": "service_unavailable"}}
    huge_date = {"Retry-After": "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"}
    async with (
        _misbehaving_replica(refusal, status=503, headers=huge_date) as url,
        realtime_service(isolated, [url]) as client,
    ):
        response = await client.post(
            "/v1/match", json={"shopper_id": "s1", "candidates": CANDIDATES, "deadline_ms": 2000}
        )
        assert response.status == 200, await response.text()
        body = await response.json()
    assert body["degraded"] is True and body["degraded_reason"] == "llm_unavailable", body
    assert all(r["source"] == "fallback" for r in body["ranked"])


async def test_an_unexpected_error_is_a_json_500_without_a_traceback(
    stack: StackState, isolated: Isolated
) -> None:
    app = create_app(
        RealtimeSettings(),
        llm_config=realtime_client_config(stack.llm_endpoints, stack.model),
        sinks=isolated.sinks(),
    )

    async def broken(request: web.Request) -> web.Response:
        raise TypeError("'int' object has no attribute 'find'")

    app.router.add_get("/broken", broken)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/broken")
        assert response.status == 500 and response.content_type == "application/json"
        text = await response.text()
        assert "Traceback" not in text and "find" not in text
        assert (await response.json())["error"]["type"] == "internal_error"
