"""The simulator over real HTTP: OpenAI shapes, streaming, usage, caching, validation, faults, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prompt_assembly.tokens import chained_block_hashes, messages_text, token_ids
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.serving.conftest import post_json

SYSTEM = "You summarise a shopper's recent catalogue activity for a recommender. " * 20
USER = "Viewed Nike Air Zoom Pegasus 41, added Garmin Forerunner 265 to basket, searched trail shoes."


def _chat(user: str = USER, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "qwen2.5-32b-sim", "messages": messages, "max_tokens": 40, **extra}


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimulator]:
    async with running_simulator(time_scale=0.0, replica_id="r7") as running:
        yield running


async def _sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with http.post(url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_chat_non_stream(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(), headers={"x-session-id": "s1"}) as r:
        assert r.status == 200
        assert r.headers["x-replica-id"] == "r7"
        body = await r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    prompt = token_ids(messages_text(_chat()["messages"]))
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] <= 40
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_chat_stream_matches_non_stream_and_ends_with_usage(
    sim: RunningSimulator, http: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/chat/completions"
    _, plain = await post_json(http, url, _chat(user="stream me " + USER))
    events = await _sse(
        http, url, _chat(user="stream me " + USER, stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # second identical prompt


async def test_stream_without_usage_option_has_no_usage(
    sim: RunningSimulator, http: aiohttp.ClientSession
) -> None:
    events = await _sse(http, f"{sim.url}/v1/chat/completions", _chat(stream=True))
    assert not any("usage" in e for e in events[:-1])


async def test_completions_stream_and_not(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    url = f"{sim.url}/v1/completions"
    prompt = "Shopper likes Lego Technic and Duplo sets."
    body = {"model": "m", "prompt": prompt, "max_tokens": 12}
    status, plain = await post_json(http, url, body)
    assert status == 200 and plain["object"] == "text_completion"
    assert plain["usage"]["prompt_tokens"] == len(token_ids(prompt))
    assert plain["usage"]["completion_tokens"] == 12 or plain["choices"][0]["finish_reason"] == "stop"
    events = await _sse(http, url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == plain["choices"][0]["text"]
    assert events[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


async def test_max_tokens_variants_and_ignore_eos(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    url = f"{sim.url}/v1/chat/completions"
    _, body = await post_json(http, url, {**_chat(), "max_tokens": None, "max_completion_tokens": 3})
    assert body["usage"]["completion_tokens"] == 3
    _, body = await post_json(http, url, _chat(max_tokens=250, ignore_eos=True))
    assert body["usage"]["completion_tokens"] == 250 and body["choices"][0]["finish_reason"] == "length"


async def test_json_schema_answer_validates(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    schema = {
        "type": "object",
        "properties": {
            "intent": {"type": "string", "enum": ["browse", "buy"]},
            "products": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "budget": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        },
        "required": ["intent", "products", "confidence", "budget"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "profile", "schema": schema}}
    for stream in (False, True):
        body = _chat(response_format=response_format, max_tokens=120, stream=stream)
        if stream:
            events = await _sse(http, f"{sim.url}/v1/chat/completions", body)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        else:
            _, reply = await post_json(http, f"{sim.url}/v1/chat/completions", body)
            text = reply["choices"][0]["message"]["content"]
            assert reply["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), schema)


async def test_cached_tokens_are_exactly_the_shared_full_blocks(
    sim: RunningSimulator, http: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/completions"
    prefix = "".join(f" w{i}" for i in range(150))  # " w12" is three tokens: " w", "1" and "2"
    first, second = prefix + " first tail" * 30, prefix + " second tail" * 30
    _, a = await post_json(http, url, {"prompt": first, "max_tokens": 2})
    _, b = await post_json(http, url, {"prompt": second, "max_tokens": 2})
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ha, hb = chained_block_hashes(token_ids(first), 32), chained_block_hashes(token_ids(second), 32)
    shared_blocks = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert shared_blocks == len(token_ids(prefix)) // 32 == 15
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == shared_blocks * 32
    _, again = await post_json(http, url, {"prompt": second, "max_tokens": 2})
    n = again["usage"]["prompt_tokens"]
    # The same prompt again: every token but the last (partial reuse takes the partly filled last block).
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1


async def test_cache_salt_isolates_and_session_header_is_ignored(
    sim: RunningSimulator, http: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/chat/completions"

    async def cached(salt: str | None, session: str) -> int:
        body = _chat(cache_salt=salt) if salt else _chat()
        async with http.post(url, json=body, headers={"x-session-id": session}) as r:
            return int((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("tenant-a", "s1") == 0
    assert await cached("tenant-b", "s1") == 0
    assert await cached(None, "s2") == 0
    assert await cached("tenant-a", "other-session") > 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": " "}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "response_format": {"type": "json_schema"}},
        ),
        ("/v1/chat/completions", [1, 2]),
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"max_tokens": 3}),
    ],
)
async def test_bad_input_is_400_with_openai_error(
    sim: RunningSimulator, http: aiohttp.ClientSession, path: str, body: Any
) -> None:
    status, reply = await post_json(http, sim.url + path, body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]


async def test_invalid_json_is_400(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/v1/chat/completions", data=b"{not json") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == 400


async def test_health_models_and_metrics(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sim.url}/health") as r:
        assert r.status == 200 and await r.json() == {"status": "ok"}
    async with http.get(f"{sim.url}/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "qwen2.5-32b-sim"
    await post_json(http, f"{sim.url}/v1/chat/completions", _chat())
    await post_json(http, f"{sim.url}/v1/chat/completions", _chat())
    async with http.get(f"{sim.url}/metrics") as r:
        text = await r.text()
    prompt_tokens = len(token_ids(messages_text(_chat()["messages"])))
    assert 'sim_requests_total{endpoint="chat"} 2.0' in text
    assert f"sim_prompt_tokens_total {2.0 * prompt_tokens}" in text
    assert "sim_cached_prompt_tokens_total" in text and "sim_completion_tokens_total" in text
    assert "sim_time_to_first_token_seconds_count 2.0" in text
    assert "sim_num_requests_running 0.0" in text and "sim_num_requests_waiting 0.0" in text
    assert "sim_kv_cache_blocks_used" in text and "sim_request_errors_total" in text
    async with http.get(f"{sim.url}/prometheus/metrics") as r:
        assert r.status == 200


async def test_error_rate_one_gives_503(http: aiohttp.ClientSession) -> None:
    async with running_simulator(time_scale=0.0, error_rate=1.0) as failing:
        status, reply = await post_json(http, f"{failing.url}/v1/chat/completions", _chat())
        assert status == 503 and reply["error"]["code"] == 503
        async with http.get(f"{failing.url}/metrics") as r:
            assert 'sim_request_errors_total{reason="injected"} 1.0' in await r.text()


async def test_admin_config_toggles_faults(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    status, reply = await post_json(http, f"{sim.url}/admin/config", {"error_rate": 1.0, "slowdown": 3.0})
    assert status == 200 and reply == {
        "slowdown": 3.0,
        "error_rate": 1.0,
        "bad_answer": "none",
        "bad_answer_rate": 1.0,
    }
    assert (await post_json(http, f"{sim.url}/v1/chat/completions", _chat()))[0] == 503
    await post_json(http, f"{sim.url}/admin/config", {"error_rate": 0.0, "bad_answer": "not_json"})
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat()) as r:
        assert r.status == 200 and r.content_type == "text/html"  # a bad answer behind a 200
    await post_json(http, f"{sim.url}/admin/config", {"bad_answer": "none"})
    assert (await post_json(http, f"{sim.url}/v1/chat/completions", _chat()))[0] == 200
    assert (await post_json(http, f"{sim.url}/admin/config", {"slowdown": -1}))[0] == 400


async def test_reset_cache_loses_the_prefix(sim: RunningSimulator, http: aiohttp.ClientSession) -> None:
    url = f"{sim.url}/v1/chat/completions"
    await post_json(http, url, _chat())
    assert (await post_json(http, url, _chat()))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, _ = await post_json(http, f"{sim.url}/admin/reset_cache", {})
    assert status == 200
    assert (await post_json(http, url, _chat()))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with http.get(f"{sim.url}/admin/stats") as r:
        stats = await r.json()
    assert stats["engine"]["served"] == 3 and stats["cache"]["lookups"] == 1
    assert stats["engine"]["cached_tokens_served"] > 0


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request_and_counts_it(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    """Streamed (noticed at the next write) or not (noticed at the next disconnect poll, or when the
    server cancels the handler): the slot is freed and ``/metrics`` counts one aborted request."""
    async with running_simulator(time_scale=0.01, stream_coalesce_s=0.0) as slow:
        body = _chat(stream=stream, max_tokens=2000, ignore_eos=True)
        if stream:
            async with http.post(f"{slow.url}/v1/chat/completions", json=body) as r:
                await r.content.readline()
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3), aiohttp.ClientSession() as own:
                    await own.post(f"{slow.url}/v1/chat/completions", json=body)
        for _ in range(200):
            if slow.replica.engine.num_running == 0 and slow.replica.stats()["engine"]["aborted"]:
                break
            await asyncio.sleep(0.02)
        stats = slow.replica.stats()
        assert stats["engine"]["aborted"] == 1 and stats["running"] == 0
        async with http.get(f"{slow.url}/metrics") as r:
            metrics = await r.text()
        assert _counter(metrics, "sim_request_errors_total", "aborted") == 1.0


def _counter(text: str, name: str, reason: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("reason") == reason:
                return sample.value
    return 0.0


async def test_admin_ttft_hands_out_each_request_once(
    sim: RunningSimulator, http: aiohttp.ClientSession
) -> None:
    for user in ("first", "second"):
        status, _ = await post_json(http, f"{sim.url}/v1/chat/completions", _chat(user))
        assert status == 200
    async with http.get(f"{sim.url}/admin/ttft") as r:
        ttfts = (await r.json())["ttft_ms"]
    assert len(ttfts) == 2 and all(t >= 0 for t in ttfts)
    async with http.get(f"{sim.url}/admin/ttft") as r:
        assert (await r.json())["ttft_ms"] == []


async def test_chunked_prefill_answers_alike_and_splits_the_prompt(http: aiohttp.ClientSession) -> None:
    body = _chat(stream=True, stream_options={"include_usage": True}, max_tokens=5, ignore_eos=True)
    usages: list[dict[str, Any]] = []
    texts: list[str] = []
    async with (
        running_simulator(time_scale=0.0) as whole,
        running_simulator(time_scale=0.0, max_num_tokens=256, enable_chunked_prefill=True) as chunked,
    ):
        for sim in (whole, chunked):
            for _ in range(2):  # the second time on the cached prefix
                events = await _sse(http, f"{sim.url}/v1/chat/completions", body)
                usages.append(events[-2]["usage"])
                texts.append("".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]))
        whole_stats, chunked_stats = whole.replica.stats()["engine"], chunked.replica.stats()["engine"]
    assert usages[:2] == usages[2:] and texts[:2] == texts[2:]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 256 and usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert whole_stats["prefill_tokens_computed"] == chunked_stats["prefill_tokens_computed"]
    # Unchunked, the prompt runs in one iteration; chunked, in pieces of the 256-token budget.
    assert chunked_stats["iterations"] >= whole_stats["iterations"] + prompt // 256


@pytest.mark.parametrize("defer", [True, False])
async def test_a_prompt_extending_one_admitted_in_the_same_iteration_waits_one_and_reuses_it(
    http: aiohttp.ClientSession, defer: bool
) -> None:
    """TensorRT-LLM's ``beneficialToSkip`` (on by default here as there): of two prompts arriving
    together, the second extends the first, so its first uncached block is one the first computes in this
    iteration; the scheduler holds it back one iteration, and it then reuses the first's blocks. With
    ``defer_shared_prefixes`` off (the simulator's earlier default), both are admitted together and both
    compute the shared prefix, which is what the router's co-batching rule
    (``PrefixAwareSettings.cobatch_window_s``) worked around."""
    first_user = "Viewed trail shoes. " * 120
    second_user = first_user + "Added Garmin Forerunner 265 to basket. " * 10
    async with running_simulator(time_scale=1.0, defer_shared_prefixes=defer) as sim:
        url = f"{sim.url}/v1/chat/completions"
        # A long cold prefill of another shopper holds the engine: both prompts below arrive while it
        # runs and meet at the next admission.
        blocker = asyncio.create_task(
            post_json(http, url, _chat(user="Other shopper. " * 1200, max_tokens=2))
        )
        while sim.replica.engine.stats.iterations == 0:  # counted when its prefill iteration starts
            await asyncio.sleep(0.005)
        (_, first), (_, second) = await asyncio.gather(
            post_json(http, url, _chat(user=first_user, max_tokens=2)),
            post_json(http, url, _chat(user=second_user, max_tokens=2)),
        )
        await blocker
        deferred = sim.replica.engine.stats.deferred
        async with http.get(f"{sim.url}/admin/ttft") as r:
            records = (await r.json())["requests"]

    def cached(body: dict[str, Any]) -> int:
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    by_prompt = {r["prompt_tokens"]: r for r in records}
    one, two = (by_prompt[b["usage"]["prompt_tokens"]] for b in (first, second))
    if defer:
        assert deferred == 1
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32  # all the first's full blocks
        assert two["queue_ms"] > one["queue_ms"]  # it waited for the first's iteration
        assert two["batch_prefill_tokens"] == two["prompt_tokens"] - two["cached_tokens"]
    else:
        # Both reuse only the system prompt the blocker left; the second none of the first's own blocks.
        assert deferred == 0
        assert cached(second) == cached(first) < first["usage"]["prompt_tokens"] - 10 * 32
        new_tokens = sum(r["prompt_tokens"] - r["cached_tokens"] for r in (one, two))
        assert one["batch_prefill_tokens"] == two["batch_prefill_tokens"] == new_tokens
