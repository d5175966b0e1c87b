"""The routing gateway against real simulator processes over HTTP.

Every replica is a ``python -m serving.simulator --port 0`` process; the gateway runs in the test's event
loop (its own aiohttp server on a free port) except in the CLI test, which starts ``shopper router
serve`` as a process. Callers are plain aiohttp clients speaking OpenAI, as any non-Python caller would.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from devstack.processes import free_port
from gateway.app import CLIENT_KEY, create_app
from gateway.config import GatewaySettings
from gateway.flights import Flight
from gateway.route import InvalidRequest, route_for
from gateway.supersede import parse_version
from llm_client.answer_health import AnswerHealthSettings
from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint, endpoint_name
from llm_client.errors import LLMError
from llm_client.routing import RouteRequest
from llm_client.routing.predicted_ttft import MAX_GROUP_WEIGHT, PredictedTtftPolicy
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from llm_client.routing.session_affinity import rendezvous_order
from pipeline.enrichment import Enricher
from prompt_assembly.prompt import build_messages
from prompt_assembly.records import ShopperInsight, Superseded, request_id
from serving.simulator.launch import REPO_ROOT, SimulatorFleet
from serving.simulator.testing import running_simulator
from tests.helpers import collector_off, serving
from tests.llm_client.test_llm_client import a_prompt

TIME_SCALE = "0.05"
"""Simulated H100 timings at 1/20: one decode step ~2.5 ms, so a 600-token stream lasts over a second."""


@dataclass
class Gateway:
    url: str
    client: LLMClient


@asynccontextmanager
async def running_gateway(
    urls: list[str],
    policy: str,
    policy_settings: dict[str, Any] | None = None,
    *,
    client: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    """A gateway in the test's loop; ``client``: more ``ClientConfig`` fields, ``settings``: the
    gateway's own."""
    config = ClientConfig.model_validate(
        {
            "endpoints": urls,
            "policy": policy,
            "policy_settings": policy_settings,
            "timeouts": {"connect_s": 0.5, "attempt_s": 20, "deadline_s": 30},
            "retry": {"max_attempts": 3, "backoff_base_s": 0.01, "budget_min_tokens": 50},
            "health": {"interval_s": 0.2},
            **(client or {}),
        }
    )
    app = create_app(GatewaySettings(port=0, **settings), config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield Gateway(f"http://127.0.0.1:{port}", app[CLIENT_KEY])
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
async def fleet() -> AsyncIterator[SimulatorFleet]:
    async with SimulatorFleet(
        3, "--time-scale", TIME_SCALE, "--kv-event-buffer-max-size", "100000"
    ) as replicas:
        yield replicas


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "qwen2.5-32b-sim", "messages": [{"role": "user", "content": content}], **fields}


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match and ",".join(sorted((match.group(2) or "").split(","))).strip(",") == wanted:
            return float(match.group(3))
    return 0.0


_DEEP = b"[" * 1000 + b"]" * 1000
"""Nesting orjson accepts (it stops at 1,024) and ``str()`` of which recursed past Python's limit."""


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        (b'{"model":"m","prompt":[' + _DEEP + b"]}", {}, None),
        (b'{"model":"m","messages":[{"role":' + _DEEP + b',"content":"x"}]}', {}, None),
        (b'{"model":"m","messages":[{"role":"user","content":' + _DEEP + b"}]}", {}, None),
        (b'{"model":"m","prompt":"x","max_tokens":-1000000000}', {}, "max_tokens"),
        (b'{"model":"m","prompt":"x","max_completion_tokens":1e18}', {}, "max_completion_tokens"),
        (b'{"model":"m","prompt":"x"}', {"x-session-id": "s", "x-session-version": "9" * 5000}, None),
        (b'{"model":"m","prompt":"x"}', {"x-session-id": "s" * 257}, "x-session-id"),
        (b'{"model":"m","prompt":"x"}', {"Idempotency-Key": "k" * 257}, "idempotency-key"),
        (b'{"model":"m","prompt":"x","user":"' + b"u" * 257 + b'"}', {}, "user"),
    ],
    ids=["deep-prompt", "deep-role", "deep-content", "negative-max-tokens", "huge-max-tokens",
         "version-5000-digits", "long-session", "long-idempotency-key", "long-user"],
)  # fmt: skip
async def test_a_hostile_request_is_a_400_never_a_500(
    fleet: SimulatorFleet,
    http: aiohttp.ClientSession,
    body: bytes,
    headers: dict[str, str],
    param: str | None,
) -> None:
    """Deep nesting that made routing's ``str()`` recurse (a 500): routing now reads only strings and
    token ids, and the replica judges the body, as it would without a gateway. Token budgets that skewed
    load accounting, session versions ``int`` refuses (a 500), and caller keys the gateway would keep
    without bound: the caller's mistake, answered by the gateway itself, no replica called."""
    async with running_gateway(fleet.urls, "prefix_aware") as gw:
        async with http.post(gw.url + "/v1/completions", data=body, headers=headers) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
        if _DEEP in body:
            assert r.headers["x-replica-id"] in {"r0", "r1", "r2"}
        else:
            assert "x-replica-id" not in r.headers
            assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"].lower() == param


@pytest.mark.parametrize("text", ["\u00b2", "1.\u00b3", "\u0663", "9" * 20, "1.2.3", "-1", "1.", ""])
def test_a_session_version_int_would_refuse_is_refused_first(text: str) -> None:
    """``str.isdigit`` takes a superscript or an Arabic-Indic digit, which ``int`` refuses: a caller
    (or a proxy in front that decodes headers as UTF-8) got a 500. Only ASCII digits, 19 at most."""
    with pytest.raises(InvalidRequest):
        parse_version(text, "x-session-version")
    assert parse_version(" 17.3 ", "x-session-version") == (17, 3) and parse_version("2", "h") == (0, 2)


async def test_requests_and_answers_pass_through_unchanged(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    async with running_gateway(fleet.urls, "round_robin") as gw:
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body("hi", max_tokens=12)) as r:
            assert r.status == 200
            assert r.headers["x-replica-id"] in {"r0", "r1", "r2"}
            assert r.headers["x-gateway-attempts"] == "1"
            answer = await r.json()
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 12
        assert answer["choices"][0]["message"]["content"]

        completion = {"model": "m", "prompt": "a shopper who views lanterns", "max_tokens": 5}
        async with http.post(gw.url + "/v1/completions", json=completion) as r:
            assert r.status == 200
            assert (await r.json())["object"] == "text_completion"

        # The replica's own 4xx reaches the caller as the replica wrote it, and is not retried.
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r:
            assert r.status == 400
            assert r.headers["x-gateway-attempts"] == "1"
            assert r.headers["x-replica-id"] in {"r0", "r1", "r2"}
            assert (await r.json())["error"]["param"] == "messages"
        # A body that cannot be routed is refused by the gateway itself.
        async with http.post(gw.url + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert "x-replica-id" not in r.headers
            assert (await r.json())["error"]["type"] == "invalid_request_error"

        async with http.get(gw.url + "/v1/models") as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["id"] == "qwen2.5-32b-sim"
        async with http.get(gw.url + "/health") as r:
            assert r.status == 200
            assert (await r.json())["routable_replicas"] == 3


async def test_stream_passes_through_chunk_by_chunk_with_usage(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    body = chat_body(
        "describe this shopper",
        max_tokens=600,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with running_gateway(fleet.urls, "least_outstanding") as gw:
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            replica_url = "http://" + r.headers["x-gateway-replica"]
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            # The caller holds the first chunk while the replica is still generating: nothing is buffered.
            async with http.get(replica_url + "/metrics") as m:
                assert metric(await m.text(), "sim_num_requests_running") == 1
            rest = await r.content.read()
        events = [e for e in (first + rest).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
        assert len(chunks) > 3
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 600 and usage["prompt_tokens"] > 0
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert len(text.split()) >= 100

        async with http.get(gw.url + "/metrics") as m:
            scraped = await m.text()
        path = "/v1/chat/completions"
        assert metric(scraped, "gateway_time_to_first_byte_seconds_count", path=path) == 1
        assert metric(scraped, "gateway_requests_total", path=path, status="200") == 1


async def test_a_caller_that_goes_away_stops_the_replica(fleet: SimulatorFleet) -> None:
    body = chat_body("a long answer nobody reads", max_tokens=600, ignore_eos=True, stream=True)
    async with running_gateway(fleet.urls, "least_outstanding") as gw, aiohttp.ClientSession() as caller:
        finished_before = await _finished_tokens(caller, fleet.urls)
        async with caller.post(gw.url + "/v1/chat/completions", json=body) as r:
            replica_url = "http://" + r.headers["x-gateway-replica"]
            await r.content.readuntil(b"\n\n")
            r.close()  # drop the connection mid-stream
        async with aiohttp.ClientSession() as probe, asyncio.timeout(10):
            while True:  # the replica drops the request once the gateway closes its connection
                async with probe.get(replica_url + "/metrics") as m:
                    if metric(await m.text(), "sim_num_requests_running") == 0:
                        break
                await asyncio.sleep(0.05)
            # ... without finishing it (a finished request would add its 600 tokens).
            assert await _finished_tokens(probe, fleet.urls) == finished_before
        assert all(e.outstanding == 0 for e in gw.client.endpoints)
        assert gw.client.in_flight == 0


async def test_a_call_whose_caller_went_away_leaves_no_reference_cycle(fleet: SimulatorFleet) -> None:
    # A cancelled flight's task held its CancelledError, whose traceback held the flight's frame and so
    # the flight, which held the task: every call a caller walked away from (its body, route and
    # buffers) waited for the cyclic collector.
    body = chat_body("a long answer nobody reads", max_tokens=600, ignore_eos=True, stream=True)
    async with running_gateway(fleet.urls, "least_outstanding") as gw, aiohttp.ClientSession() as caller:
        with collector_off():
            before = _live_flights()
            async with caller.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.content.readuntil(b"\n\n")
                r.close()  # drop the connection mid-stream
            assert await _flights_left_once_idle(gw, before) == [], (
                "a stopped flight is kept alive by a reference cycle"
            )


async def test_an_answer_that_broke_off_mid_stream_leaves_no_reference_cycle() -> None:
    # The flight kept the LLMError it broke off with, whose traceback held the flight's own frame and so
    # the flight: every answer a replica cut off (its body, route and buffered chunks) waited for the
    # cyclic collector.
    body = chat_body("a long answer cut off", max_tokens=600, ignore_eos=True, stream=True)
    async with (
        SimulatorFleet(1, "--time-scale", TIME_SCALE) as sims,
        running_gateway(sims.urls, "round_robin") as gw,
        aiohttp.ClientSession() as caller,
    ):
        with collector_off():
            before = _live_flights()
            async with caller.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.content.readuntil(b"\n\n")
                sims.kill(0)
                await read_broken_off(r)
            assert await _flights_left_once_idle(gw, before) == [], (
                "a flight that broke off is kept alive by a reference cycle"
            )
        async with caller.get(gw.url + "/metrics") as m:
            assert (
                metric(await m.text(), "gateway_broken_answers_total", replica=sims.urls[0].split("://")[1])
                == 1
            )


async def test_one_broken_stream_three_callers_share_counts_one_broken_answer() -> None:
    # Three callers joined by an Idempotency-Key share one call; its stream breaks off (over the
    # answer limit). Counted where each caller's stream ended, it was three broken answers and three
    # warnings for one replica's fault.
    body = chat_body("one keyed stream, cut at 4 KiB", stream=True, max_tokens=600, ignore_eos=True)
    async with (
        SimulatorFleet(1, "--time-scale", TIME_SCALE) as sims,
        running_gateway(sims.urls, "round_robin", client={"answer_limits": {"max_answer_bytes": 4096}}) as gw,
        aiohttp.ClientSession() as http,
    ):

        async def caller() -> None:
            async with http.post(
                gw.url + "/v1/chat/completions", json=body, headers={"idempotency-key": "k-broken"}
            ) as r:
                assert r.status == 200
                await r.read()

        await asyncio.gather(caller(), caller(), caller())
        async with http.get(gw.url + "/metrics") as m:
            text = await m.text()
    assert metric(text, "gateway_idempotent_total", outcome="joined") == 2, "the three did not share a call"
    assert metric(text, "gateway_broken_answers_total", replica=sims.urls[0].split("://")[1]) == 1


async def test_a_replica_breaking_mid_stream_does_not_eject_the_gateway_from_a_client_in_front() -> None:
    """A replica that breaks off after an event: the gateway ends the caller's stream with an ``error``
    event (a 502) and the stream's clean end. It closed the caller's connection instead, and an
    ``LLMClient`` in front ejected the gateway at once for a broken connection: often its only
    endpoint, so every call of that process waited for the next health check, for one replica's fault."""

    async def breaks_after_one_event(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "Lik"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # the replica dies mid-answer
        return response

    async with (
        replica_answering(breaks_after_one_event) as url,
        running_gateway([url], "round_robin") as gw,
        LLMClient(ClientConfig(endpoints=[gw.url], retry={"max_attempts": 1})) as client,
    ):
        with pytest.raises(LLMError) as failed:
            await client.chat([{"role": "user", "content": "a shopper"}], routing_key="s-1", max_tokens=8)
        gateway = client.endpoints[0]
        text = await scrape_gateway(gw.url)
    assert "bad_gateway" in str(failed.value), failed.value
    assert gateway.ejections == 0 and gateway.healthy, "the gateway was ejected for one replica's fault"
    assert metric(text, "gateway_requests_total", path="/v1/chat/completions", status="broken") == 1


async def read_broken_off(response: aiohttp.ClientResponse) -> None:
    """The rest of a stream whose replica broke off: at an event's end, an ``error`` event (the 502) and
    no ``[DONE]``; mid-event, the connection cut. Never a short clean answer."""
    try:
        rest = await response.content.read()
    except aiohttp.ClientPayloadError:
        return
    assert b'"bad_gateway"' in rest and b"[DONE]" not in rest, rest[-300:]


async def scrape_gateway(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return await r.text()


async def test_a_stopped_gateway_keeps_no_answer_alive(fleet: SimulatorFleet) -> None:
    # aiohttp caches each application's handlers in a module-level cache that outlives the application,
    # and through the proxy's bound method its idempotency store: every answer kept for a repeat stayed
    # in memory after the gateway stopped (found as another test's Flight in the reference-cycle tests).
    body = chat_body("kept for a repeat", max_tokens=20)
    before = _live_flights()
    async with running_gateway(fleet.urls, "least_outstanding") as gw, aiohttp.ClientSession() as caller:
        async with caller.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
        ) as r:
            assert r.status == 200
            await r.read()
        assert [f for f in _live_flights() if f not in before], "the answer was not kept for a repeat"
    gc.collect()
    assert [f for f in _live_flights() if f not in before] == [], "a stopped gateway still holds answers"


def _live_flights() -> list[Flight]:
    return [o for o in gc.get_objects() if isinstance(o, Flight)]


async def _flights_left_once_idle(gw: Gateway, before: list[Flight]) -> list[Flight]:
    """The flights still alive once the gateway has no call in flight, of those not in ``before`` (with
    the collector off, only those nothing but a reference cycle holds)."""
    async with asyncio.timeout(10):
        while gw.client.in_flight:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # the flight's task's done callbacks
    return [f for f in _live_flights() if f not in before]


async def test_the_policy_hears_of_the_first_token_while_the_answer_still_streams(
    fleet: SimulatorFleet,
) -> None:
    """prefix_aware's co-batching rule takes a replica's first token as the end of an iteration: the
    proxy must report it when it passes through, not when the answer ends."""
    body = chat_body("a long answer", max_tokens=600, ignore_eos=True, stream=True, user="wren")
    async with running_gateway(fleet.urls, "prefix_aware") as gw, aiohttp.ClientSession() as caller:
        policy = gw.client.policy
        assert isinstance(policy, PrefixAwarePolicy)
        async with caller.post(gw.url + "/v1/chat/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            assert gw.client.in_flight == 1  # still streaming
            assert sum(policy._queued.first_tokens(e.name) for e in gw.client.endpoints) == 1
            assert len(policy._queued) == 0
            await r.read()
        assert sum(policy._queued.first_tokens(e.name) for e in gw.client.endpoints) == 1  # once


async def _finished_tokens(http: aiohttp.ClientSession, urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        async with http.get(url + "/metrics") as m:
            total += metric(await m.text(), "sim_completion_tokens_total")
    return total


async def test_shopper_key_from_header_or_user_field_gives_affinity(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    async with running_gateway(fleet.urls, "session_affinity") as gw:
        seen: dict[str, set[str]] = {}
        for i in range(8):
            shopper = f"shopper-{i}"
            for step in range(2):
                by_header = http.post(
                    gw.url + "/v1/chat/completions",
                    json=chat_body(f"step {step}", max_tokens=4),
                    headers={"x-session-id": shopper},
                )
                by_user = http.post(
                    gw.url + "/v1/chat/completions",
                    json=chat_body(f"step {step}", max_tokens=4, user=shopper),
                )
                for call in (by_header, by_user):
                    async with call as r:
                        assert r.status == 200
                        seen.setdefault(shopper, set()).add(r.headers["x-gateway-replica"])
        for shopper, replicas in seen.items():
            expected = rendezvous_order(shopper, gw.client.endpoints)[0].name
            assert replicas == {expected}, shopper
        assert len(set().union(*seen.values())) > 1, "eight shoppers should not all hash to one replica"


async def test_prefix_aware_follows_the_cache_of_a_growing_prompt(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    def messages(shopper: str, events: int) -> list[dict[str, str]]:
        lines = [
            f"- 10:{i:02d} viewed: <data>{shopper} lantern {i}</data> by Brand{i % 5}, ${i}.49\n"
            for i in range(events)
        ]
        return build_messages(shopper, lines)

    async with running_gateway(fleet.urls, "prefix_aware") as gw:
        for i in range(4):
            shopper = f"kv-{i}"
            replicas, cached = [], []
            for events in (40, 44, 48):
                body = {
                    "model": "m",
                    "messages": messages(shopper, events),
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "user": shopper,
                }
                async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                    replicas.append(r.headers["x-gateway-replica"])
                    raw = await r.read()
                usage = orjson.loads(raw.split(b"\n\n")[-3][len(b"data: ") :])["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            assert len(set(replicas)) == 1, replicas
            assert cached[1] > 0 and cached[2] > cached[1]
        async with http.get(gw.url + "/metrics") as m:
            scraped = await m.text()
        assert metric(scraped, "gateway_policy_cache_hits_total", policy="prefix_aware") >= 8


async def test_precise_prefix_aware_follows_kv_events_of_traffic_it_never_saw(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    """Several gateways (or clients) share the replicas in production: a prompt cached through another
    one is known to this gateway only from the replica's own KV cache events."""
    precise = {"policy": "prefix_aware", "kv_events": "precise", "kv_events_poll_s": 0.05}
    shopper = f"kv-events-{uuid.uuid4().hex[:8]}"
    lines = [f"- 10:{i:02d} viewed: <data>lantern {i}</data> by Brand{i % 5}\n" for i in range(60)]
    body = {"model": "m", "messages": build_messages(shopper, lines), "max_tokens": 4}
    async with running_gateway(fleet.urls, "prefix_aware", precise) as gw:
        # The replica this gateway would pick last for the shopper serves the prompt directly.
        elsewhere = rendezvous_order(shopper, gw.client.endpoints)[-1]
        async with http.post(elsewhere.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        applied = 0.0
        async with asyncio.timeout(10):  # until the gateway has polled the replicas' POST /kv_cache_events
            while applied == 0:
                await asyncio.sleep(0.05)
                async with http.get(gw.url + "/metrics") as m:
                    applied = metric(await m.text(), "gateway_policy_kv_events_total", policy="prefix_aware")
            while gw.client.policy.cached_tokens(_route(body, shopper), elsewhere) == 0:  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
        async with http.post(
            gw.url + "/v1/chat/completions", json=body, headers={"x-session-id": shopper}
        ) as r:
            assert r.status == 200
            assert r.headers["x-gateway-replica"] == elsewhere.name
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _route(body: dict[str, Any], key: str) -> RouteRequest:
    return route_for(
        orjson.dumps(body), {"x-session-id": key}, key_header="x-session-id", default_max_tokens=4
    )


@pytest.mark.slow
async def test_failover_when_replicas_are_killed(http: aiohttp.ClientSession) -> None:
    async with (
        SimulatorFleet(4, "--time-scale", TIME_SCALE) as sims,
        running_gateway(sims.urls, "round_robin", deadline_s=5.0) as gw,
    ):
        index = {url.split("://", 1)[1]: i for i, url in enumerate(sims.urls)}
        dead: list[str] = []

        # 1. Killed while computing a non-streamed answer (whose status line comes with the whole body):
        #    nothing reached the caller, so another replica answers it.
        async def whole_answer() -> tuple[int, str, str, Any]:
            body = chat_body("a whole answer", max_tokens=300, ignore_eos=True)
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                return (
                    r.status,
                    r.headers["x-gateway-replica"],
                    r.headers["x-gateway-attempts"],
                    await r.json(),
                )

        call = asyncio.create_task(whole_answer())
        async with asyncio.timeout(10):
            while not any(e.outstanding for e in gw.client.endpoints):
                await asyncio.sleep(0.005)
        dead.append(next(e.name for e in gw.client.endpoints if e.outstanding))
        sims.kill(index[dead[-1]])
        status, replica, attempts, answer = await call
        assert (status, attempts) == (200, "2")
        assert replica not in dead
        assert answer["usage"]["completion_tokens"] == 300

        # 2. Killed mid-stream: the caller hears it broke off, never gets a short clean answer.
        body = chat_body("a long answer", max_tokens=600, ignore_eos=True, stream=True)
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            dead.append(r.headers["x-gateway-replica"])
            await r.content.readuntil(b"\n\n")
            sims.kill(index[dead[-1]])
            await read_broken_off(r)

        # 3. Killed while idle: requests routed to it are retried on the survivor.
        dead.append(next(name for name in index if name not in dead))
        sims.kill(index[dead[-1]])
        tries = []
        for i in range(6):
            async with http.post(gw.url + "/v1/chat/completions", json=chat_body(f"q{i}", max_tokens=4)) as r:
                assert r.status == 200
                assert r.headers["x-gateway-replica"] not in dead
                tries.append(int(r.headers["x-gateway-attempts"]))
        assert max(tries) == 2

        async with http.get(gw.url + "/metrics") as m:
            scraped = await m.text()
        assert metric(scraped, "gateway_broken_answers_total", replica=dead[1]) == 1
        for name in dead:
            assert metric(scraped, "gateway_replica_routable", replica=name) == 0
            assert metric(scraped, "gateway_replica_ejections_total", replica=name) >= 1
        assert metric(scraped, "gateway_retries_total") >= 1
        async with http.get(gw.url + "/health") as r:
            assert r.status == 200 and (await r.json())["routable_replicas"] == 1

        # 4. The last one gone: the caller gets the gateway's error within its deadline, /health says 503.
        sims.kill(next(i for name, i in index.items() if name not in dead))
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body("q", max_tokens=4)) as r:
            assert r.status == 504
            assert (await r.json())["error"]["type"] == "timeout"
        async with http.get(gw.url + "/health") as r:
            assert r.status == 503


async def test_cli_serves_the_gateway_from_several_processes_on_one_port(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "shopper",
        "router",
        "serve",
        "--port",
        str(port),
        "--policy",
        "prefix_aware",
    ]
    for url in fleet.urls:
        argv += ["--endpoint", url]
    env = {**os.environ, "GATEWAY_REUSE_PORT": "true"}
    processes: list[asyncio.subprocess.Process] = []
    try:
        for _ in range(2):  # one process per core, sharing the port (SO_REUSEPORT)
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=REPO_ROOT,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            processes.append(process)
            assert process.stdout is not None
            async with asyncio.timeout(60):
                settings = orjson.loads(await process.stdout.readline())
                ready = (await process.stdout.readline()).decode()
            assert settings["llm"]["endpoints"] == fleet.urls
            assert ready.strip() == f"READY http://127.0.0.1:{port}"
        url = f"http://127.0.0.1:{port}"
        processes[0].terminate()
        await asyncio.wait_for(processes[0].wait(), 10)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            for i in range(3):  # new connections all reach the process that is left
                async with fresh.post(
                    url + "/v1/chat/completions",
                    json=chat_body("hi", max_tokens=3),
                    headers={"x-session-id": f"s{i}"},
                ) as r:
                    assert r.status == 200
                    assert (await r.json())["usage"]["completion_tokens"] == 3
            async with fresh.get(url + "/metrics") as m:
                assert metric(await m.text(), "gateway_policy_decisions_total", policy="prefix_aware") == 3
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
            await asyncio.wait_for(process.wait(), 10)


async def test_callers_need_the_api_key_when_one_is_set(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    async with running_gateway(fleet.urls, "round_robin", api_key="s3cret-key") as gw:
        url = gw.url + "/v1/chat/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Basic s3cret-key"}, {"X-API-Key": "s3cret-key"}):  # fmt: skip
            async with http.post(url, json=chat_body("hi", max_tokens=2), headers=headers) as r:
                assert r.status == 401, headers
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                error = (await r.json())["error"]
                assert error["type"] == "authentication_error" and error["code"] == 401
                assert "x-replica-id" not in r.headers, "refused before any replica saw it"
        async with http.get(gw.url + "/v1/models") as r:
            assert r.status == 401
        for scheme in ("Bearer", "bearer"):
            headers = {"Authorization": f"{scheme} s3cret-key"}
            async with http.post(url, json=chat_body("hi", max_tokens=2), headers=headers) as r:
                assert r.status == 200 and r.headers["x-replica-id"] in {"r0", "r1", "r2"}
        async with http.get(gw.url + "/health") as r:
            assert r.status == 200, "probes need no key"
        for n in range(20):  # paths a caller without a key makes up: one label value, not a series each
            async with http.get(f"{gw.url}/junk-{n}") as r:
                assert r.status == 401
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert metric(text, "gateway_requests_total", path="/v1/chat/completions", status="401") == 5
        assert metric(text, "gateway_requests_total", path="unmatched", status="401") == 20
        assert "junk" not in text
    assert "s3cret-key" not in GatewaySettings(api_key="s3cret-key").model_dump_json()


async def test_body_size_is_limited_and_configurable(
    fleet: SimulatorFleet, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert GatewaySettings().max_body_bytes == 1024 * 1024
    monkeypatch.setenv("GATEWAY_MAX_BODY_BYTES", "4096")
    assert GatewaySettings().max_body_bytes == 4096
    monkeypatch.delenv("GATEWAY_MAX_BODY_BYTES")

    async def chunked(data: bytes) -> AsyncIterator[bytes]:  # no Content-Length: cut while read
        for start in range(0, len(data), 1024):
            yield data[start : start + 1024]

    for limit, fits, too_big in ((None, 900_000, 1_100_000), (4096, 3000, 5000)):
        settings: dict[str, Any] = {} if limit is None else {"max_body_bytes": limit}
        async with running_gateway(fleet.urls, "least_outstanding", **settings) as gw:
            url = gw.url + "/v1/chat/completions"
            # the bulk in a field the replica ignores: a prompt that long is over its max_num_tokens
            ok = orjson.dumps(chat_body("hi", max_tokens=2, metadata={"note": "x" * (fits - 200)}))
            async with http.post(url, data=ok, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200, (limit, len(ok))
            big = orjson.dumps(chat_body("x" * too_big, max_tokens=2))
            for body in (big, chunked(big)):
                async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 413, limit
                    error = (await r.json())["error"]
                    assert error["type"] == "payload_too_large" and error["code"] == 413
                    assert str(limit or 1024 * 1024) in error["message"]


async def test_large_bodies_are_routed_off_the_event_loop_the_same_way(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    """A body over ``offload_body_bytes`` is parsed and hashed in a worker thread: it is routed exactly
    as the same body parsed on the loop (same replica, the policy sees the cached prefix)."""
    # under the replicas' max_num_tokens (8192), which they refuse a longer prompt over with a 400
    prompt = "".join(f"- viewed: <data>lantern {i} with a long description</data>\n" for i in range(300))
    offload_at = 1024
    replicas = []
    for offload in (10**9, offload_at):  # on the loop, then in a thread
        async with running_gateway(fleet.urls, "prefix_aware", offload_body_bytes=offload) as gw:
            for step in range(2):
                body = chat_body(prompt + f"step {step}", max_tokens=2)
                async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    replicas.append(r.headers["x-gateway-replica"])
            async with http.get(gw.url + "/metrics") as r:
                text = await r.text()
            assert metric(text, "gateway_policy_cache_hits_total", policy="prefix_aware") >= 1
    assert len(orjson.dumps(chat_body(prompt))) > offload_at
    assert replicas[0] == replicas[1] and replicas[2] == replicas[3]


async def test_group_weights_change_live_through_the_admin_route_and_show_on_metrics(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    groups = {
        "groups": [
            {"name": "local", "endpoints": fleet.urls[:2]},
            {"name": "east", "endpoints": fleet.urls[2:], "rtt_ms": 40},
        ]
    }
    settings = {"policy": "predicted_ttft", **groups}
    keys = {"api_key": "caller-key", "admin_api_key": "admin-key"}
    async with running_gateway(
        fleet.urls, "predicted_ttft", settings, api_key=keys["api_key"], admin_api_key=keys["admin_api_key"]
    ) as gw:
        auth = {"Authorization": "Bearer admin-key"}
        url = gw.url + "/admin/groups/east/weight"
        for caller in ({}, {"Authorization": "Bearer caller-key"}):
            async with http.put(url, json={"weight": 0.25}, headers=caller) as r:
                assert r.status == 401, "the admin route takes the admin key, not the callers' key"
        async with http.put(url, json={"weight": 0.25}, headers=auth) as r:
            assert r.status == 200 and (await r.json())["groups"] == {"local": 1.0, "east": 0.25}
        for path, body in (
            ("/admin/groups/west/weight", b'{"weight": 1}'),
            (url[len(gw.url) :], b'{"weight": -1}'),
            (url[len(gw.url) :], b'{"weight": Infinity}'),
            (url[len(gw.url) :], b'{"weight": 1e309}'),  # read as infinity by a JSON parser
            (url[len(gw.url) :], b'{"weight": NaN}'),
            (url[len(gw.url) :], orjson.dumps({"weight": 10 * MAX_GROUP_WEIGHT})),
        ):
            async with http.put(gw.url + path, data=body, headers=auth) as r:
                assert r.status == 400, (path, body)
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert metric(text, "gateway_group_weight", group="east") == 0.25
        assert metric(text, "gateway_group_weight", group="local") == 1.0
    async with (
        running_gateway(fleet.urls, "round_robin", admin_api_key="admin-key") as gw,
        http.get(gw.url + "/admin/groups", headers=auth) as r,
    ):
        assert r.status == 404


async def test_the_admin_routes_are_off_without_an_admin_key_of_their_own(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    """The admin routes were opened by the callers' key, and by nothing when no key was set: any caller
    could take a region out of rotation."""
    groups = {"groups": [{"name": "local", "endpoints": fleet.urls[:2]}, {"name": "east", "endpoints": []}]}
    settings = {"policy": "predicted_ttft", **groups}
    for api_key in (None, "caller-key"):
        async with running_gateway(fleet.urls, "predicted_ttft", settings, api_key=api_key) as gw:
            caller = {"Authorization": "Bearer caller-key"}
            async with http.put(
                gw.url + "/admin/groups/east/weight", json={"weight": 0}, headers=caller
            ) as r:
                assert r.status == 403 and "GATEWAY_ADMIN_API_KEY" in (await r.json())["error"]["message"]
            policy = gw.client.policy
            assert isinstance(policy, PredictedTtftPolicy) and policy.group_weights()["east"] == 1.0
    with pytest.raises(ValueError, match="GATEWAY_ADMIN_API_KEY"):
        GatewaySettings(api_key="same", admin_api_key="same")


async def test_the_gateway_makes_the_two_step_pd_call_and_streams_from_the_decode_server(
    http: aiohttp.ClientSession,
) -> None:
    from llm_client.routing.pd_aware import PdAwarePolicy
    from tests.llm_client.test_routing_pd_aware import words

    async with (
        running_simulator(role="context", time_scale=0.0) as ctx,
        running_simulator(role="generation", time_scale=0.0) as gen,
    ):
        config = ClientConfig.model_validate(
            {
                "endpoints": [gen.url],
                "context_endpoints": [ctx.url],
                "policy": "pd_aware",
                "timeouts": {"connect_s": 0.5, "attempt_s": 20, "deadline_s": 30},
                "health": {"interval_s": 0.2},
            }
        )
        app = create_app(GatewaySettings(port=0), config)
        async with serving(app) as base:
            url = f"{base}/v1/chat/completions"
            history = words(3000)
            body = chat_body(history, max_tokens=20, stream=True, user="s1")
            async with http.post(url, json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                streamed = (await r.read()).decode()
            assert streamed.rstrip().endswith("data: [DONE]")
            policy = app[CLIENT_KEY].policy
            assert isinstance(policy, PdAwarePolicy) and policy.stats.remote == 1
            async with http.get(f"{gen.url}/perf_metrics") as r:
                (record,) = await r.json()
            assert record["simulator"]["transferred_blocks"] > 0, "the decode server pulled the KV cache"
            body = chat_body(history + words(200, "new"), max_tokens=20, stream=True, user="s1")
            async with http.post(url, json=body) as r:
                assert r.status == 200
                await r.read()
            assert policy.stats.local_small == 1, "the shopper's newest events were prefilled locally"


def key_for(replica: str, urls: list[str]) -> str:
    """A shopper key that ``session_affinity`` sends to ``replica`` first."""
    endpoints = [Endpoint(url, endpoint_name(url)) for url in urls]
    return next(
        f"shopper-{i}" for i in range(1000) if rendezvous_order(f"shopper-{i}", endpoints)[0].url == replica
    )


LIMITS = {"max_answer_bytes": 1024}
"""The smallest answer limit: a simulator's answer of a few hundred tokens is over it, one of a few
tokens far under it."""
HEALTH = AnswerHealthSettings(window=10, min_invalid=3, invalid_share=0.5, cooldown_s=0.2)


async def test_good_answers_count_so_a_few_bad_ones_among_them_quarantine_no_one(
    http: aiohttp.ClientSession,
) -> None:
    """The gateway recorded only bad answers: any three over the process's life quarantined a replica,
    and a caller could aim them with ``x-session-id`` (three oversized answers were enough)."""
    async with (
        running_simulator(time_scale=0.0) as a,
        running_simulator(time_scale=0.0) as b,
        running_gateway(
            [a.url, b.url],
            "session_affinity",
            client={"answer_limits": LIMITS, "answer_health": HEALTH.model_dump()},
        ) as gw,
    ):
        key = key_for(a.url, [a.url, b.url])
        target = gw.client.endpoints[0]
        good_per_bad = HEALTH.window // HEALTH.min_invalid
        for _ in range(HEALTH.min_invalid + 1):
            for _ in range(good_per_bad):
                body = chat_body("hi there", max_tokens=5)
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=sid(key)) as r:
                    assert r.status == 200 and r.headers["x-gateway-replica"] == target.name
            oversized = chat_body("hi there", max_tokens=400)
            async with http.post(gw.url + "/v1/chat/completions", json=oversized, headers=sid(key)) as r:
                await r.read()
        assert target.invalid_answers == {"too_large": HEALTH.min_invalid + 1}
        assert not target.quarantined, "a bad answer in every few good ones is not a bad replica"


def sid(key: str) -> dict[str, str]:
    return {"x-session-id": key}


@asynccontextmanager
async def replica_answering(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A replica of a test's own: ``chat`` answers the chat route, and its health check passes."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    async with serving(app) as url:
        yield url


SERVED_MODEL = "qwen-served"


@asynccontextmanager
async def model_checking_replica() -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """A server that checks model names, as trtllm-serve and vLLM do (404 for a model it does not
    serve); while ``state["oversized"]`` it answers every request with more than ``LIMITS`` allow."""
    state = {"oversized": True}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") != SERVED_MODEL:
            error = {"message": f"model {body.get('model')!r} not found", "type": "NotFoundError"}
            return web.json_response({"error": error}, status=404)
        text = "x" * (2 * LIMITS["max_answer_bytes"]) if state["oversized"] else "ok"
        answer = {"model": SERVED_MODEL, "choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
        return web.json_response(answer)

    async with replica_answering(chat) as url:
        yield url, state


async def test_a_quarantined_replica_is_probed_with_the_callers_model_name(
    http: aiohttp.ClientSession,
) -> None:
    """The gateway's probe sent ``"model": "default"`` (its client's default): a server that checks model
    names refused that probe forever. It now sends a request a replica answered well: the caller's own
    model name."""
    async with (
        model_checking_replica() as (strict, state),
        running_simulator(time_scale=0.0) as healthy,
        running_gateway(
            [strict, healthy.url],
            "session_affinity",
            client={"answer_limits": LIMITS, "answer_health": HEALTH.model_dump()},
        ) as gw,
    ):
        key = key_for(strict, [strict, healthy.url])
        replica = gw.client.endpoints[0]
        body = {**chat_body("hi there", max_tokens=5), "model": SERVED_MODEL}
        while not replica.quarantined:
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=sid(key)) as r:
                await r.read()
        state["oversized"] = False  # fixed, but out of rotation until a probe passes
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=sid(key)) as r:
            assert r.status == 200 and r.headers["x-gateway-replica"] != replica.name
        async with asyncio.timeout(10):  # cool-downs of 0.2 s; before the fix it never came back
            while replica.quarantined:
                await asyncio.sleep(HEALTH.cooldown_s)
        assert replica.routable and gw.client.answer_health.readmissions == 1


@asynccontextmanager
async def gateway_client(fleet: SimulatorFleet) -> AsyncIterator[tuple[Gateway, LLMClient]]:
    """A fresh gateway in front of ``fleet`` and a client of it, as the stream jobs on the stack call it."""
    async with running_gateway(fleet.urls, "prefix_aware") as gw:
        config = ClientConfig(endpoints=[gw.url], model="qwen2.5-32b-sim")
        async with LLMClient(config) as client:
            yield gw, client


async def test_a_pipeline_calling_the_gateway_sizes_its_limit_by_the_fleet_behind_it(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    """The stream jobs call the stack's gateway, one address: their admission limit is still sized per
    replica behind it (the gateway says how many in every answer), each insight names the replica
    that answered, and a job's ``scope`` keeps its prompts its own: the same prompt from another job
    is paid for again, from the same job it is answered from the gateway's kept answer."""
    async with gateway_client(fleet) as (gw, client):
        job_a, job_b = Enricher(client, scope="job-a:"), Enricher(client, scope="job-b:")
        floor_before = job_a.fleet_limit.floor
        prompt = a_prompt()
        first = await job_a.enrich(prompt)
        other_job = await job_b.enrich(prompt)
        async with http.get(gw.url + "/metrics") as r:
            reused_before = metric(await r.text(), "gateway_idempotent_total", outcome="reused")
        again = await Enricher(client, scope="job-a:").enrich(prompt)  # job a, restarted
        async with http.get(gw.url + "/metrics") as r:
            reused = metric(await r.text(), "gateway_idempotent_total", outcome="reused") - reused_before
    assert floor_before == 1, "one address, and nothing heard from it yet"
    assert job_a.fleet_limit.floor == 3
    assert job_a.fleet_limit.ceiling == 3 * job_a.settings.overload.per_replica_in_flight
    replicas = {endpoint_name(url) for url in fleet.urls}
    assert all(isinstance(r, ShopperInsight) for r in (first, other_job, again))
    assert {first.replica, other_job.replica, again.replica} <= replicas  # type: ignore[union-attr]
    assert reused_before == 0, "another job's prompt under the same request_id is its own call"
    assert reused == 1, "the restarted job's repeat is answered from the kept answer"


async def test_a_replayed_prompt_the_gateway_saw_superseded_becomes_a_superseded_result(
    fleet: SimulatorFleet,
) -> None:
    """A job killed after sending a shopper's newer prompt and restarted replays the older one too; the
    gateway refuses it (409: it saw the newer version). The job records it as superseded by that newer
    prompt, counted apart, not as an error."""
    older = a_prompt()
    seq = older.seq + 1
    newer = older.model_copy(
        update={"seq": seq, "request_id": request_id(older.shopper_id, older.session_epoch, seq)}
    )
    async with gateway_client(fleet) as (_, client):
        assert isinstance(await Enricher(client, scope="job:").enrich(newer), ShopperInsight)
        restarted = Enricher(client, scope="job:")
        result = await restarted.enrich(older)
    assert isinstance(result, Superseded), result
    assert result.cause == "newer_prompt" and result.superseded_by == newer.request_id
    assert restarted.counts.superseded_upstream == 1


async def test_a_replayed_prompt_with_other_messages_under_the_same_id_is_a_call_of_its_own(
    fleet: SimulatorFleet, http: aiohttp.ClientSession
) -> None:
    """A prompt a wall-clock timer fired may be rebuilt after a restart with more events under the same
    ``request_id``: another prompt, so it is answered by a call of its own (not refused with a 422 for
    a key sent with another body), while the same messages again are answered from the kept answer."""
    first = a_prompt()
    extended = first.model_copy(
        update={"messages": [*first.messages[:-1], {**first.messages[-1], "content": "one more event"}]}
    )
    async with gateway_client(fleet) as (gw, client):
        assert isinstance(await Enricher(client, scope="job:").enrich(first), ShopperInsight)
        restarted = Enricher(client, scope="job:")
        other = await restarted.enrich(extended)
        same = await Enricher(client, scope="job:").enrich(first)
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert isinstance(other, ShopperInsight) and isinstance(same, ShopperInsight), (other, same)
    assert metric(text, "gateway_idempotent_total", outcome="reused") == 1


@asynccontextmanager
async def replica_streaming(events: bytes, linger_s: float = 0.0) -> AsyncIterator[tuple[str, list[str]]]:
    """A replica that streams ``events`` (SSE bytes) to every call and holds the stream open ``linger_s``
    more before closing it (a busy server, a proxy that closes late); yields its URL and the session
    header of each call it got."""
    calls: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls.append(request.headers.get("x-session-id", ""))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(events)
        await asyncio.sleep(linger_s)
        return response

    async with replica_answering(chat) as url:
        yield url, calls


async def test_a_streaming_caller_that_leaves_before_the_first_token_closes_the_replicas_request(
    http: aiohttp.ClientSession,
) -> None:
    """The replica sends its status line at once and its first token only after its queue and prefill
    (as ``trtllm-serve`` and the simulator do). A caller that left in between went unnoticed until the
    first chunk, so the replica computed the prefill for nobody; the gateway now closes the upstream
    request within its caller check."""
    closed = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(3000):  # 30 s: a long queue before the first token
            if request.transport is None or request.transport.is_closing():
                closed.set()
                return response
            await asyncio.sleep(0.01)
        await response.write(ONE_TOKEN_STREAM)
        return response

    async with replica_answering(chat) as url, running_gateway([url], "round_robin") as gw:
        body = chat_body("hi", stream=True)
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        # The caller has left (its response closed) with no token read: the replica hears of it.
        await asyncio.wait_for(closed.wait(), timeout=10)
        text = await scrape(http, gw.url)
        assert metric(text, "gateway_requests_total", path="/v1/chat/completions", status="caller_gone") == 1


ONE_TOKEN_STREAM = (
    b"data: "
    + orjson.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok"}}]})
    + b"\n\ndata: [DONE]\n\n"
)


async def test_an_answer_read_to_its_done_line_is_not_superseded_by_the_sessions_next_call(
    http: aiohttp.ClientSession,
) -> None:
    """A caller reads a stream to ``data: [DONE]`` and sends its next request at once, while the replica
    has not closed the stream yet. The same session's next call (here the same version under another
    key, as a replay that rebuilt a timer-fired prompt sends) superseded the first call, still open, and
    cancelled it: its answer, already with its caller, was not kept, so a repeat of its key paid for
    it again (found by the project's CI, where the replica's close came late)."""
    async with (
        replica_streaming(ONE_TOKEN_STREAM, 1.0) as (url, calls),
        running_gateway([url], "session_affinity") as gw,
    ):

        async def call(key: str) -> str | None:
            headers = {"x-session-id": "s-1", "x-session-version": "3.7", "Idempotency-Key": key}
            body = chat_body("hi", stream=True)
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.strip() == b"data: [DONE]":
                        break
                return r.headers.get("x-gateway-idempotent")

        assert await call("first") is None
        assert await call("replayed-other-messages") is None
        await asyncio.sleep(1.5)  # both streams closed
        assert await call("first") == "reused"
    assert calls == ["s-1", "s-1"], "the repeat of the first key was answered from its kept answer"
