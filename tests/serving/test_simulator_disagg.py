"""Simulator roles: disaggregated context and generation replicas over real HTTP, KV memory pins, and the
cost of a mixed prefill + decode iteration.

A test client plays TensorRT-LLM's disaggregated front end: it sends the request to a context replica as
``context_only``, then the same request with the returned ``disaggregated_params`` as ``generation_only``
to a generation replica, which pulls the KV cache from the context replica.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_assembly.tokens import token_ids
from serving.simulator import cost_model, disagg
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.config import SimulatorConfig
from serving.simulator.cost_model import KV_BYTES_PER_TOKEN, CostModel, KvLink, mixed_iteration_ms
from serving.simulator.disagg import OpaqueState, first_gen_token
from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, EngineLimits, GenerationRequest
from serving.simulator.prefix_cache import BlockPrefixCache
from serving.simulator.replica import engine_limits
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.serving.conftest import post_json

COST = CostModel.from_calibration(SimulatorConfig().resolved_calibration_path(), "qwen2.5-32b")
BS = 32


def _prompt(tag: str, words: int) -> str:
    """``words`` tokens after a tag that makes the prompt (and its blocks) unique to the caller."""
    return f"{tag}:" + " alpha" * words


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200
        return await response.json()


async def _context(
    http: aiohttp.ClientSession, ctx: RunningSimulator, body: dict[str, Any]
) -> dict[str, Any]:
    """The front end's first hop: the prompt's KV cache and first token; returns the response."""
    status, reply = await post_json(
        http, f"{ctx.url}/v1/completions", {**body, "disaggregated_params": {"request_type": "context_only"}}
    )
    assert status == 200, reply
    return reply


def _generation_body(body: dict[str, Any], ctx_reply: dict[str, Any]) -> dict[str, Any]:
    params = {**ctx_reply["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return {**body, "disaggregated_params": params}


async def _stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float | None, str, dict[str, Any]]:
    """Stream a completion; returns the loop time of the first content chunk, the text, the usage."""
    loop = asyncio.get_running_loop()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event["choices"] and event["choices"][0]["text"]:
                first = first if first is not None else loop.time()
                text.append(event["choices"][0]["text"])
            usage = event.get("usage") or usage
    return first, "".join(text), usage


async def _disaggregated(
    http: aiohttp.ClientSession, ctx: RunningSimulator, gen: RunningSimulator, body: dict[str, Any]
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    ctx_reply = await _context(http, ctx, body)
    _, text, usage = await _stream(http, f"{gen.url}/v1/completions", _generation_body(body, ctx_reply))
    return ctx_reply, text, usage


def _by_ctx_id(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["ctx_request_id"]: r for r in records}


# ---- protocol ---------------------------------------------------------------------------------------
async def test_context_replica_answers_the_first_token_and_the_generation_replica_the_rest(
    http: aiohttp.ClientSession,
) -> None:
    body = _body(_prompt("protocol", 300), 12)
    async with (
        running_simulator(time_scale=0.0) as agg,
        running_simulator(role="context", time_scale=0.0) as ctx,
        running_simulator(role="generation", time_scale=0.0) as gen,
    ):
        _, whole = await post_json(http, f"{agg.url}/v1/completions", body)
        ctx_reply = await _context(http, ctx, {**body, "stream": True})  # never streamed
        params = ctx_reply["choices"][0]["disaggregated_params"]
        assert params["request_type"] == "context_only" and params["draft_tokens"] is None
        assert ctx_reply["usage"]["completion_tokens"] == 1
        first_piece = ctx_reply["choices"][0]["text"]
        assert whole["choices"][0]["text"].startswith(first_piece)
        assert params["first_gen_tokens"] == [first_gen_token(first_piece)]
        state = OpaqueState.decode(params["opaque_state"])
        assert state == OpaqueState(
            ctx_url=ctx.url,
            ctx_request_id=params["ctx_request_id"],
            block_hashes_count=len(token_ids(body["prompt"])) // BS,
        )
        assert ctx.replica.cache.pinned_blocks == state.block_hashes_count  # held for the pull

        _, text, usage = await _stream(http, f"{gen.url}/v1/completions", _generation_body(body, ctx_reply))
        assert text == whole["choices"][0]["text"]  # the first streamed piece is the context's token
        assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 12
        assert ctx.replica.cache.pinned_blocks == 0 and gen.replica.cache.pinned_blocks == 0
        # A second context replica's id space is its own; ids are unique per replica.
        again = await _context(http, ctx, _body(_prompt("protocol-2", 50), 3))
        assert again["choices"][0]["disaggregated_params"]["ctx_request_id"] == params["ctx_request_id"] + 1

        # Requests sent to the wrong pool, and malformed params, are 400s that say why.
        for url, request_type in ((agg.url, "context_only"), (ctx.url, "generation_only")):
            extra = {"first_gen_tokens": [1], "opaque_state": params["opaque_state"]}
            status, reply = await post_json(
                http,
                f"{url}/v1/completions",
                {**body, "disaggregated_params": {"request_type": request_type, **extra}},
            )
            assert status == 400 and "role" in reply["error"]["message"]
        for bad in ({"request_type": "generation_only"}, {"request_type": "x"}):
            status, _ = await post_json(
                http, f"{gen.url}/v1/completions", {**body, "disaggregated_params": bad}
            )
            assert status == 400
        bad_state = {
            "request_type": "generation_only",
            "first_gen_tokens": [1],
            "opaque_state": "bm90IGpzb24=",
        }
        status, reply = await post_json(
            http, f"{gen.url}/v1/completions", {**body, "disaggregated_params": bad_state}
        )
        assert status == 400 and reply["error"]["param"] == "disaggregated_params.opaque_state"
        status, _ = await post_json(http, f"{agg.url}/internal/kv_transfer", {"ctx_request_id": 1})
        assert status == 404
        # Plain requests are served by every role.
        for sim in (ctx, gen):
            status, reply = await post_json(http, f"{sim.url}/v1/completions", _body(_prompt("plain", 40), 3))
            assert status == 200 and reply["usage"]["completion_tokens"] == 3


async def test_a_generation_replica_decodes_a_prompt_longer_than_its_iteration_without_chunking(
    http: aiohttp.ClientSession,
) -> None:
    """TensorRT-LLM refuses a prompt longer than ``max_num_tokens`` without chunked prefill, but not a
    ``generation_only`` one (``LLM._check_arguments`` skips gen-only requests): its KV cache comes from the
    context server. A generation replica refusing it threw away the context step (every such prompt of a
    P/D run with max_num_tokens 2048 became an error). Prefilling the same prompt there is still refused."""
    body = _body(_prompt("longer-than-an-iteration", 300), 8)
    chunked = {"enable_chunked_prefill": True, "max_num_tokens": 128}
    async with (
        running_simulator(role="context", time_scale=0.0, **chunked) as ctx,
        running_simulator(role="generation", time_scale=0.0, max_num_tokens=128) as gen,
    ):
        assert not gen.replica.config.enable_chunked_prefill
        ctx_reply = await _context(http, ctx, body)
        status, reply = await post_json(http, f"{gen.url}/v1/completions", _generation_body(body, ctx_reply))
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == 8
        status, reply = await post_json(http, f"{gen.url}/v1/completions", body)
        assert status == 400 and "should not exceed max_num_tokens (128)" in reply["error"]["message"]


def test_every_role_holds_running_blocks_by_default_and_the_old_engine_stays_an_option() -> None:
    for role in ("aggregated", "context", "generation"):
        limits = engine_limits(SimulatorConfig(role=role))
        assert limits.pin_blocks is True and limits.capacity_policy == "guaranteed_no_evict"
    assert engine_limits(SimulatorConfig(pin_running_blocks=False)).pin_blocks is False


# ---- TTFT identity ----------------------------------------------------------------------------------
@pytest.mark.slow
async def test_ttft_is_queue_plus_prefill_plus_transfer_plus_first_decode_step(
    http: aiohttp.ClientSession,
) -> None:
    """At time scale 1, the client's time to first token through the context and generation replicas
    is the sum of the parts the replicas report: the context replica's queue and prefill iteration, the
    generation replica's queue, wait for a receive slot, transfer, and first decode step.

    Tolerance: no part can end early (each is an ``asyncio.sleep`` to a deadline), so the measured
    time is at least the sum (1 ms for clock rounding). Above it is what the replicas do not model:
    three local HTTP hops (client to context, client to generation, generation's pull), JSON, and
    tokenising and hashing the 2k-token prompt on both replicas (docs/simulator.md measured 2.5-8 ms per
    request on a 2-core machine), and asyncio's sleeps overshooting, by up to 10% on some VMs (6-12 ms
    on a 100 ms sleep). So the best of three must be within 30 ms + half the sum: loose for the
    host, tight enough to catch a part waited twice (the prefill alone is most of the sum). Within
    3% of the sum failed on such a VM with nothing else running."""
    async with (
        running_simulator(role="context", time_scale=1.0, replica_id="ctx") as ctx,
        running_simulator(role="generation", time_scale=1.0, replica_id="gen") as gen,
    ):
        loop = asyncio.get_running_loop()
        await _disaggregated(http, ctx, gen, _body(_prompt("warm-up", 64), 2))
        await _get(http, f"{ctx.url}/perf_metrics")
        await _get(http, f"{gen.url}/perf_metrics")
        measured: dict[int, float] = {}
        for attempt in range(3):
            body = _body(_prompt(f"identity-{attempt}", 2000), 3)
            t0 = loop.time()
            ctx_reply = await _context(http, ctx, body)
            first, _, _ = await _stream(http, f"{gen.url}/v1/completions", _generation_body(body, ctx_reply))
            assert first is not None
            measured[ctx_reply["choices"][0]["disaggregated_params"]["ctx_request_id"]] = 1000 * (first - t0)
        ctx_perf = _by_ctx_id(await _get(http, f"{ctx.url}/perf_metrics"))
        gen_perf = _by_ctx_id(await _get(http, f"{gen.url}/perf_metrics"))

    excess: list[float] = []
    for ctx_id, ttft_ms in measured.items():
        c, g = ctx_perf[ctx_id]["simulator"], gen_perf[ctx_id]["simulator"]
        n = c["prompt_tokens"]
        # Each modelled part is what the cost model says for this request alone.
        assert c["prefill_ms"] == pytest.approx(ctx.replica.cost.prefill_ms(n), abs=1e-3)
        blocks = math.ceil(n / BS)
        assert g["transferred_blocks"] == blocks
        assert g["transfer_ms"] == pytest.approx(
            KvLink(0.5, 400.0).transfer_ms(blocks * BS * KV_BYTES_PER_TOKEN["qwen2.5-32b"]), abs=1e-3
        )
        assert g["first_iteration_ms"] == pytest.approx(gen.replica.cost.decode_step_ms(1, n + 1), abs=1e-3)
        parts = (c["queue_ms"] + c["prefill_ms"] + g["queue_ms"] + g["kv_wait_ms"] + g["transfer_ms"]) + g[
            "first_iteration_ms"
        ]
        assert ttft_ms >= parts - 1.0, (ttft_ms, parts)
        excess.append(ttft_ms - parts - (0.5 * parts + 30.0))
    assert min(excess) <= 0, excess


# ---- decode isolation -------------------------------------------------------------------------------
async def test_a_prefill_burst_stretches_decode_gaps_when_aggregated_but_not_on_a_generation_replica(
    http: aiohttp.ClientSession,
) -> None:
    """One long decode, then a burst of six 2k-token prompts. Aggregated, the burst's prefills run in
    the long request's decode iterations, so its largest inter-token gap is a whole prefill iteration;
    disaggregated, they run on the context replica and the generation replica's iterations stay decode
    steps (of a batch the burst's short decodes join). Gaps are simulated iteration times, so host
    jitter cannot move them."""
    scale = 0.01
    long_body = _body(_prompt("long", 500), 400)
    burst = [_body(_prompt(f"burst-{i}", 2000), 3) for i in range(6)]
    long_tokens = len(token_ids(long_body["prompt"]))

    async with running_simulator(time_scale=scale) as agg:
        url = f"{agg.url}/v1/completions"
        long = asyncio.create_task(_stream(http, url, long_body))
        while agg.replica.engine.stats.decode_tokens < 3:
            await asyncio.sleep(0.001)
        await asyncio.gather(*(post_json(http, url, b) for b in burst))
        await long
        records = await _get(http, f"{agg.url}/perf_metrics")
    agg_long = next(r for r in records if r["simulator"]["completion_tokens"] == 400)["simulator"]

    async with (
        running_simulator(role="context", time_scale=scale) as ctx,
        running_simulator(role="generation", time_scale=scale) as gen,
    ):
        long_ctx = await _context(http, ctx, long_body)
        gen_url = f"{gen.url}/v1/completions"
        long = asyncio.create_task(_stream(http, gen_url, _generation_body(long_body, long_ctx)))
        while gen.replica.engine.stats.decode_tokens < 3:
            await asyncio.sleep(0.001)
        await asyncio.gather(*(_disaggregated(http, ctx, gen, b) for b in burst))
        assert not long.done()  # the burst ran beside the long decode
        await long
        records = await _get(http, f"{gen.url}/perf_metrics")
    pd_long = next(r for r in records if r["simulator"]["completion_tokens"] == 400)["simulator"]

    alone = COST.decode_step_ms(1, long_tokens + 400)
    widest_decode = max(COST.decode_step_ms(b, b * (2000 + long_tokens + 400)) for b in range(1, 8))
    assert pd_long["max_itl_ms"] <= max(widest_decode, alone) + 1e-6
    assert pd_long["max_itl_ms"] < 1.25 * alone
    # However the burst's arrivals fall into iterations, one gap holds at least a whole 2k prefill.
    assert agg_long["max_itl_ms"] >= COST.prefill_ms(2000) > 4 * alone


# ---- selective transfer and KV events ---------------------------------------------------------------
async def test_a_shoppers_next_request_moves_only_its_new_blocks(http: aiohttp.ClientSession) -> None:
    first = _body(_prompt("shopper-7", 400), 4)
    second = _body(first["prompt"] + " beta" * 150, 4)
    h1 = engine_block_hashes(token_ids(first["prompt"]), BS)
    h2 = engine_block_hashes(token_ids(second["prompt"]), BS)
    assert h2[: len(h1)] == h1  # the second prompt extends the first one's full blocks
    n1, n2 = len(token_ids(first["prompt"])), len(token_ids(second["prompt"]))

    async with (
        running_simulator(role="context", time_scale=0.0, kv_event_buffer_max_size=100) as ctx,
        running_simulator(role="generation", time_scale=0.0, kv_event_buffer_max_size=100) as gen,
    ):
        await post_json(http, f"{gen.url}/kv_cache_events", {})  # drop the "created" event
        ctx_one, _, _ = await _disaggregated(http, ctx, gen, first)
        ctx_two, _, usage = await _disaggregated(http, ctx, gen, second)
        records = _by_ctx_id(await _get(http, f"{gen.url}/perf_metrics"))
        async with http.post(f"{gen.url}/kv_cache_events") as r:
            events = await r.json()

    one = records[ctx_one["choices"][0]["disaggregated_params"]["ctx_request_id"]]
    two = records[ctx_two["choices"][0]["disaggregated_params"]["ctx_request_id"]]
    assert one["simulator"]["transferred_blocks"] == math.ceil(n1 / BS)  # everything, partial block included
    assert two["simulator"]["transferred_blocks"] == math.ceil(n2 / BS) - len(h1)  # only what is new
    assert two["perf_metrics"]["kv_cache_metrics"]["num_reused_blocks"] == len(h1)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(h1) * BS
    # The context replica reused all of it too, its partly filled last block included (partial reuse).
    assert ctx_two["usage"]["prompt_tokens_details"]["cached_tokens"] == len(token_ids(first["prompt"]))
    # The generation replica publishes what it pulled, each block once, as stored events.
    stored = [b["block_hash"] for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]
    assert stored == h1 + h2[len(h1) :]


# ---- KV memory: pins and the transfer timeout -------------------------------------------------------
async def test_pinned_blocks_are_never_evicted_and_a_late_pull_finds_the_kv_cache_gone(
    http: aiohttp.ClientSession,
) -> None:
    """A context replica with room for 40 blocks holds a 25-block prompt for its pull; a second 25-block
    prompt waits for room instead of evicting it, and runs once the first is pulled. The second is
    never pulled: after ``kv_transfer_timeout_s`` its blocks are released, and a pull gets
    ``kv_cache_gone``, 404 from the context replica, 409 from the generation replica to its client."""
    p1, p2 = _body(_prompt("pinned-1", 799), 3), _body(_prompt("pinned-2", 799), 3)
    h1 = engine_block_hashes(token_ids(p1["prompt"]), BS)
    h2 = engine_block_hashes(token_ids(p2["prompt"]), BS)
    assert len(h1) == len(h2) == 25
    async with (
        running_simulator(
            role="context",
            time_scale=0.0,
            cache_capacity_blocks=40,
            kv_transfer_timeout_s=1.0,
            kv_event_buffer_max_size=100,
        ) as ctx,
        running_simulator(role="generation", time_scale=0.0) as gen,
    ):
        one = await _context(http, ctx, p1)
        assert ctx.replica.cache.pinned_blocks == 25
        second = asyncio.create_task(_context(http, ctx, p2))
        await asyncio.sleep(0.05)
        assert not second.done() and ctx.replica.engine.num_waiting == 1  # waits for room
        assert ctx.replica.cache.longest_prefix(h1) == 25
        async with http.post(f"{ctx.url}/kv_cache_events") as r:
            assert not [e for e in await r.json() if e["data"]["type"] == "removed"]

        _, text, _ = await _stream(http, f"{gen.url}/v1/completions", _generation_body(p1, one))
        assert text
        two = await asyncio.wait_for(second, 5)  # the pull released the first prompt's blocks
        assert ctx.replica.cache.pinned_blocks == 25 and ctx.replica.cache.longest_prefix(h2) == 25
        async with http.post(f"{ctx.url}/kv_cache_events") as r:
            removed = [
                h for e in await r.json() if e["data"]["type"] == "removed" for h in e["data"]["block_hashes"]
            ]
        # The second holds its 25 blocks and one for its partial last block and first token: only the
        # first prompt's (unpinned) blocks went, as many as that overflows.
        assert len(removed) == len(h1) + len(h2) + 1 - 40 and set(removed) <= set(h1)

        await asyncio.sleep(1.3)  # past kv_transfer_timeout_s (wall seconds at time scale 0)
        assert ctx.replica.cache.pinned_blocks == 0
        assert ctx.replica.stats()["kv_transfer"]["expired"] == 1
        ctx_id = two["choices"][0]["disaggregated_params"]["ctx_request_id"]
        status, reply = await post_json(
            http, f"{ctx.url}/internal/kv_transfer", {"ctx_request_id": ctx_id, "block_hashes": h2}
        )
        assert status == 404 and reply["error"]["type"] == "kv_cache_gone"
        status, reply = await post_json(http, f"{gen.url}/v1/completions", _generation_body(p2, two))
        assert status == 409 and reply["error"]["type"] == "kv_cache_gone"
        assert gen.replica.cache.pinned_blocks == 0 and gen.replica.cache.reserved_blocks == 0
        # The client recovers by redoing the prefill.
        _, text, _ = await _disaggregated(http, ctx, gen, p2)
        assert text


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "pin", "unpin", "reserve"]), st.integers(0, 7), st.integers(1, 6)
        ),
        max_size=60,
    )
)
def test_pinned_blocks_stay_whatever_is_inserted(ops: list[tuple[str, int, int]]) -> None:
    cache = BlockPrefixCache(capacity_blocks=12, block_size=4)
    prompts = [[p * 100 + i for i in range(6)] for p in range(8)]
    pins: list[list[int]] = []
    for op, p, n in ops:
        blocks = prompts[p][:n]
        if op == "insert":
            cache.insert(blocks)
        elif op == "pin":
            if cache.can_hold(cache.blocks_to_hold(blocks)):
                pins.append(cache.insert(blocks, pin=True))
        elif op == "unpin" and pins:
            cache.unpin(pins.pop(p % len(pins)))
        elif op == "reserve" and cache.can_hold(n):
            cache.reserve(n)
            cache.unreserve(n)
        held = {h for run in pins for h in run}
        assert all(cache.longest_prefix([h]) == 1 for h in held)  # never evicted while pinned
        assert cache.pinned_blocks == len(held)
        assert cache.used_blocks <= max(cache.capacity_blocks, len(held))
    for run in pins:
        cache.unpin(run)
    assert cache.pinned_blocks == 0


# ---- conservation -----------------------------------------------------------------------------------
async def test_disaggregation_costs_the_same_gpu_time_as_aggregated_at_low_load(
    http: aiohttp.ClientSession,
) -> None:
    """One request at a time, additive mode: aggregated, a request costs its prefill iteration and
    max_tokens - 1 decode steps; disaggregated, the context replica's prefill iteration plus the
    generation replica's max_tokens - 1 decode steps, on the same contexts. Nothing is lost or counted
    twice: equal within float rounding (0.01%)."""
    bodies = [_body(_prompt(f"conserve-{i}", 1500 + 300 * i), 20) for i in range(3)]
    async with (
        running_simulator(time_scale=0.0) as agg,
        running_simulator(role="context", time_scale=0.0) as ctx,
        running_simulator(role="generation", time_scale=0.0) as gen,
    ):
        for body in bodies:
            status, _ = await post_json(http, f"{agg.url}/v1/completions", body)
            assert status == 200
            await _disaggregated(http, ctx, gen, body)
        busy = {
            name: (await _get(http, f"{sim.url}/admin/stats"))["engine"]
            for name, sim in (("agg", agg), ("ctx", ctx), ("gen", gen))
        }
    assert busy["agg"]["served"] == busy["ctx"]["served"] == busy["gen"]["served"] == 3
    assert busy["ctx"]["busy_ms"] + busy["gen"]["busy_ms"] == pytest.approx(busy["agg"]["busy_ms"], rel=1e-4)
    assert busy["ctx"]["busy_ms"] == pytest.approx(
        sum(agg.replica.cost.prefill_ms(len(token_ids(b["prompt"]))) for b in bodies), rel=1e-9
    )


# ---- mixed batches ----------------------------------------------------------------------------------
def test_fused_mixed_iteration_pays_the_larger_part_and_additive_the_sum() -> None:
    assert mixed_iteration_ms(250.0, 54.0, "additive") == 304.0
    assert mixed_iteration_ms(250.0, 54.0, "fused") == 250.0
    assert mixed_iteration_ms(30.0, 54.0, "fused") == 54.0
    for mode in ("additive", "fused"):  # a pure step costs the same either way
        assert mixed_iteration_ms(250.0, 0.0, mode) == 250.0
        assert mixed_iteration_ms(0.0, 54.0, mode) == 54.0


async def test_engine_charges_a_mixed_iteration_by_the_configured_rule() -> None:
    """A (100 tokens) is admitted alone (the token budget has no room for B beside it); the next
    iteration prefills B (2000 tokens) while decoding A: the mixed one; the last decodes A alone."""
    busy = {}
    for mode in ("additive", "fused"):
        config = SimulatorConfig(max_num_tokens=2050, mixed_batch_cost=mode)
        engine = ContinuousBatchingEngine(
            COST, BlockPrefixCache(1000, BS), engine_limits(config), EngineKnobs(time_scale=0.0)
        )
        a = GenerationRequest("a", 100, [1000 + i for i in range(3)], 3)
        b = GenerationRequest("b", 2000, [2000 + i for i in range(62)], 1)
        for r in (a, b):
            engine.submit(r)
        await asyncio.wait_for(asyncio.gather(a.done.wait(), b.done.wait()), 10)
        assert engine.stats.iterations == 3 and b.batch_running == 1
        busy[mode] = engine.stats.busy_ms
    prefill_b, decode_a = COST.prefill_ms(2000), COST.decode_step_ms(1, 101)
    rest = COST.prefill_ms(100) + COST.decode_step_ms(1, 102)
    assert busy["additive"] == pytest.approx(rest + prefill_b + decode_a, rel=1e-12)
    assert busy["fused"] == pytest.approx(rest + max(prefill_b, decode_a), rel=1e-12)
    assert EngineLimits(8, 8192).mixed_batch_cost == "additive"


def test_docs_name_every_setting_and_the_functions_they_cite() -> None:
    """docs/simulator.md lists every ``SimulatorConfig`` field as a flag, and the names its
    disaggregation and mixed-batch sections cite exist."""
    doc = (Path(__file__).resolve().parents[2] / "docs/simulator.md").read_text()
    missing = [f for f in SimulatorConfig.model_fields if "--" + f.replace("_", "-") not in doc]
    assert not missing
    cited = ((cost_model, "mixed_iteration_ms"), (cost_model, "KV_BYTES_PER_TOKEN"), (disagg, "OpaqueState"))
    for module, name in cited:
        assert hasattr(module, name)
        assert f"`{module.__name__.rsplit('.', 1)[-1]}.{name}`" in doc
