"""Defects a review of the simulator found, each shown against real replicas over HTTP (or, for the P/D
router's pure join, against ``DisaggPerfMetrics`` itself, as its own tests do):

- an aborted ``generation_only`` request freed its batch slot only when its KV pull ended;
- a request paused under MAX_UTILIZATION and readmitted reported its readmission's cache hit (its own
  released blocks) as ``cached_tokens``;
- with ``--chunk-block-reuse`` a chunk's blocks were counted as both pinned and booked;
- the P/D router's ``/perf_metrics`` maps refused new records once full, so joins stopped for good;
- ``/admin/reset_cache`` with requests in flight dropped their pins, and a later request's pins with them.

Every wait is a poll with a generous bound; no assertion is on speed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import aiohttp

from prompt_assembly.tokens import token_ids
from serving.disagg_router.perf_metrics import DisaggPerfMetrics, DisaggRequestTimes
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.llm_client.test_routing_pd_aware import words
from tests.serving.conftest import post_json
from tests.serving.test_disagg_router import EVENTS, chat_stream, get_json, stand_in
from tests.serving.test_simulator_memory import _prompt

BS = 32


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def _cached(reply: dict[str, Any]) -> int:
    cached: int = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.002)


async def _stats(http: aiohttp.ClientSession, sim: RunningSimulator) -> dict[str, Any]:
    body: dict[str, Any] = await get_json(http, f"{sim.url}/admin/stats")
    return body


# ---- 1. an aborted generation_only request frees its batch slot during its KV pull -------------------
async def test_a_client_leaving_during_the_kv_pull_frees_the_batch_slot_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """A generation replica with one batch slot pulls a KV cache that takes a minute to arrive. The
    client leaves during the pull: the slot and the KV memory the request booked go back at once, so
    a plain request is served while the pull is still on the wire. Before, the aborted request held the
    slot until its pull ended, and the plain request waited behind it for the whole minute."""
    body = _body(_prompt(100, "abort-during-pull"), 8)
    async with (
        running_simulator(
            role="context", time_scale=1.0, kv_transfer_latency_ms=60_000.0, kv_transfer_timeout_s=600.0
        ) as ctx,
        running_simulator(role="generation", time_scale=0.0, max_batch=1) as gen,
    ):
        status, ctx_reply = await post_json(
            http,
            f"{ctx.url}/v1/completions",
            {**body, "disaggregated_params": {"request_type": "context_only"}},
        )
        assert status == 200, ctx_reply
        params = {**ctx_reply["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
        gen_body = {**body, "disaggregated_params": params}

        async with aiohttp.ClientSession() as leaving:
            pulled = asyncio.create_task(post_json(leaving, f"{gen.url}/v1/completions", gen_body))
            # The pull is on the wire: admitted, transferring, and the context replica is sending it.
            await _until(
                lambda: gen.replica.engine.num_transferring == 1 and ctx.replica.kv_sender.pending == 0
            )
            assert gen.replica.engine.num_running == 1
            pulled.cancel()  # the client goes away: its connection closes
            await asyncio.gather(pulled, return_exceptions=True)

        await _until(lambda: gen.replica.engine.num_running == 0)
        assert ctx.replica.kv_sender.sent == 0, "the pull is still in flight"
        kv = (await _stats(http, gen))["kv_blocks"]
        assert kv["pinned"] == kv["reserved"] == 0
        async with asyncio.timeout(10.0):  # the freed slot serves another request at once
            status, reply = await post_json(http, f"{gen.url}/v1/completions", _body(_prompt(40, "next"), 3))
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        assert ctx.replica.kv_sender.sent == 0
        assert gen.replica.engine.stats.aborted == 1


# ---- 2. a paused and readmitted request reports its first admission's cached tokens -----------------
async def test_a_paused_request_reports_the_prefix_reuse_of_its_first_admission(
    http: aiohttp.ClientSession,
) -> None:
    """Under MAX_UTILIZATION two requests start and the later one is paused when memory runs out, then
    readmitted once the first is done. The later one's prompt shares its first 5 blocks with a prompt
    served before: that is the reuse its client sees (160 tokens), whatever the readmission finds. Its
    readmission found its own released blocks, and it reported 319 of its 320 tokens as cached."""
    prompt_tokens, max_tokens = 320, 400
    blocks_each = math.ceil((prompt_tokens + max_tokens) / BS)
    first = _prompt(prompt_tokens, "paused-first")
    later = _prompt(prompt_tokens, "paused-later")
    shared = " ".join(later.split(" ")[: 5 * BS + 1])  # the later prompt's first 160 tokens
    assert token_ids(later)[: 5 * BS] == token_ids(shared)
    async with running_simulator(
        time_scale=0.001,
        cache_capacity_blocks=2 * blocks_each - 2,
        capacity_policy="max_utilization",
        max_seq_len=4096,
    ) as sim:
        url = f"{sim.url}/v1/completions"
        status, _ = await post_json(http, url, _body(shared, 1))
        assert status == 200
        one = asyncio.create_task(post_json(http, url, _body(first, max_tokens)))
        await _until(lambda: sim.replica.engine.num_running == 1)
        two = asyncio.create_task(post_json(http, url, _body(later, max_tokens)))
        (s1, r1), (s2, r2) = await asyncio.gather(one, two)
        stats = await _stats(http, sim)
        records = await get_json(http, f"{sim.url}/perf_metrics")
    assert s1 == s2 == 200
    assert stats["engine"]["paused"] >= 1, "the later request was paused and readmitted"
    assert r2["usage"]["completion_tokens"] == max_tokens
    assert _cached(r1) == 0
    assert _cached(r2) == 5 * BS
    # /perf_metrics says the same (and its reused blocks follow from it).
    served = [r for r in records if r["simulator"]["completion_tokens"] == max_tokens]
    assert sorted(r["simulator"]["cached_tokens"] for r in served) == [0, 5 * BS]
    reused = sorted(r["perf_metrics"]["kv_cache_metrics"]["num_reused_blocks"] for r in served)
    assert reused == [0, 5]


# ---- 3. --chunk-block-reuse counts a chunk's blocks once --------------------------------------------
async def test_chunk_block_reuse_does_not_count_a_chunks_blocks_as_pinned_and_booked(
    http: aiohttp.ClientSession,
) -> None:
    """A cache of exactly 16 blocks holds a 5-block prompt served before (unpinned) and then a 10-block
    prompt prefilled in 64-token chunks that books one block for its 32 tokens: 5 + 10 + 1 = 16, so
    nothing needs evicting. With ``--chunk-block-reuse`` each chunk's stored blocks were pinned while the
    room booked for them stayed booked, so the prompt counted as up to 18 blocks, and the first prompt's
    blocks were evicted for room nobody used."""
    early = _prompt(5 * BS, "chunk-early")
    chunked = _prompt(10 * BS, "chunk-long")
    early_hashes = engine_block_hashes(token_ids(early), BS)
    async with running_simulator(
        time_scale=0.0,
        enable_chunked_prefill=True,
        chunk_block_reuse=True,
        max_num_tokens=64,
        cache_capacity_blocks=16,
        kv_event_buffer_max_size=1000,
    ) as sim:
        url = f"{sim.url}/v1/completions"
        status, _ = await post_json(http, url, _body(early, 1))
        assert status == 200 and sim.replica.cache.longest_prefix(early_hashes) == 5
        await post_json(http, f"{sim.url}/kv_cache_events", {})  # drop what came before
        status, reply = await post_json(http, url, _body(chunked, BS))
        assert status == 200 and reply["usage"]["completion_tokens"] == BS
        assert (await _stats(http, sim))["engine"]["iterations"] >= 5, "prefilled in several chunks"
        async with http.post(f"{sim.url}/kv_cache_events") as response:
            events = await response.json()
        assert not [e for e in events if e["data"]["type"] == "removed"]
        assert sim.replica.cache.longest_prefix(early_hashes) == 5
        status, again = await post_json(http, url, _body(early, 1))
        assert status == 200 and _cached(again) == 5 * BS - 1  # all of it (never the last token)
        kv = (await _stats(http, sim))["kv_blocks"]
        assert kv["pinned"] == kv["reserved"] == 0


# ---- 4. the P/D router's /perf_metrics keeps joining once its maps are full -------------------------
async def test_the_routers_perf_metrics_keep_joining_after_an_unjoinable_record() -> None:
    """With ``perf_metrics_max_requests`` 1, a request the generation server prefilled itself (the
    conditional rule) leaves a record without a ``ctx_request_id`` there. It took the generation map's
    one place for good: every later generation record was refused, and no request was answered again."""
    history = words(3000)
    async with (
        running_simulator(role="context", time_scale=0.0, **EVENTS) as ctx,
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as gen,
        stand_in(ctx, gen, perf_metrics_max_requests=1) as (url, service),
        aiohttp.ClientSession() as http,
    ):
        await chat_stream(http, url, history)
        (record,) = await get_json(http, f"{url}/perf_metrics")
        assert record["ctx_perf_metrics"] is not None

        await chat_stream(http, url, history + words(100, "new"))
        assert service.counters.local_prefills == 1, "prefilled on the generation server"
        assert await get_json(http, f"{url}/perf_metrics") == []

        for i in range(3):
            await chat_stream(http, url, words(3000, f"cold{i}"))
            (record,) = await get_json(http, f"{url}/perf_metrics")
            assert record["ctx_perf_metrics"] is not None and record["gen_perf_metrics"] is not None
            assert record["timing"] is not None
        assert service.counters.context_requests == 4


def _times(ctx_request_id: int) -> DisaggRequestTimes:
    return DisaggRequestTimes("c", "g", ctx_request_id, 0.0, 0.1, 0.2, 0.3, 0.4)


def _record(ctx_request_id: int | None) -> dict[str, Any]:
    timing = {"arrival_time": 0.0, "first_token_time": 1.0, "last_token_time": 2.0}
    return {"ctx_request_id": ctx_request_id, "perf_metrics": {"timing_metrics": timing}}


def test_orphaned_records_age_out_instead_of_shutting_new_ones_out() -> None:
    """Context records nobody asks for (their requests finished on the context server, or failed on the
    generation server) filled the context map, and later requests were joined without their context
    record. The oldest go now, so a new record always finds a place."""
    perf = DisaggPerfMetrics(max_requests=2)
    assert perf.collect({"c": [_record(1), _record(2)], "g": [_record(None)]}) == []
    for n in (3, 4, 5):
        perf.add(_times(n))
        (joined,) = perf.collect({"c": [_record(n)], "g": [_record(n)]})
        assert joined["ctx_request_id"] == n
        assert joined["ctx_perf_metrics"] == _record(n) and joined["timing"] is not None
    assert len(perf) == 0


# ---- 5. /admin/reset_cache leaves the pins of requests in flight alone ------------------------------
async def test_reset_cache_with_requests_in_flight_keeps_their_pins_exact(
    http: aiohttp.ClientSession,
) -> None:
    """A reset while a request runs drops every unpinned block, not the blocks that request holds. It
    dropped them too, pins and all: a second request with the same prompt then stored and pinned them
    once, the first request's unpin at its end took that pin, and the second ran on blocks nothing
    pinned (evictable under it)."""
    prompt = _prompt(10 * BS, "reset-in-flight")
    hashes = engine_block_hashes(token_ids(prompt), BS)
    other = _prompt(4 * BS, "reset-other")
    async with running_simulator(time_scale=0.1, kv_event_buffer_max_size=1000) as sim:
        url = f"{sim.url}/v1/completions"
        await post_json(http, url, _body(other, 1))  # an unpinned block or four to drop
        cache = sim.replica.cache
        one = asyncio.create_task(post_json(http, url, _body(prompt, 300)))
        await _until(lambda: cache.pinned_blocks == len(hashes) and sim.replica.engine.num_running == 1)
        await post_json(http, f"{sim.url}/kv_cache_events", {})

        status, reset = await post_json(http, f"{sim.url}/admin/reset_cache", {})
        assert status == 200
        assert cache.pinned_blocks == len(hashes), "the running request's blocks stay pinned"
        assert reset["kv_blocks_used"] == cache.used_blocks == len(hashes)
        assert cache.longest_prefix(engine_block_hashes(token_ids(other), BS)) == 0
        async with http.post(f"{sim.url}/kv_cache_events") as response:
            events = [e["data"] for e in await response.json()]
        assert [e["type"] for e in events] == ["removed"] and len(events[0]["block_hashes"]) == 4

        two = asyncio.create_task(post_json(http, url, _body(prompt, 900)))
        await _until(lambda: sim.replica.engine.num_running == 2)
        assert not one.done(), "the second request started while the first ran"
        status, _ = await one
        assert status == 200
        assert not two.done()
        assert cache.pinned_blocks == len(hashes) and all(cache.is_pinned(h) for h in hashes)
        status, reply = await two
        assert status == 200 and _cached(reply) == len(token_ids(prompt)) - 1
        kv = (await _stats(http, sim))["kv_blocks"]
        assert kv["pinned"] == kv["reserved"] == 0
