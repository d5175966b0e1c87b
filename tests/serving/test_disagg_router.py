"""The ``trtllm-serve disaggregated`` stand-in (``serving/disagg_router/``): TensorRT-LLM's router score
on a hand-built block table, its other routers, the YAML, the conditional rule at its boundary, and the
two-step call with ``/perf_metrics`` against simulator context and generation replicas over HTTP."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prompt_assembly.errors import ConfigurationError
from prompt_assembly.tokens import messages_text, token_ids
from serving.disagg_router.app import SERVICE, create_app
from serving.disagg_router.config import ConditionalDisagg, DisaggConfig, RouterSettings
from serving.disagg_router.errors import NoServerAvailable, RouterRefusal
from serving.disagg_router.routers import (
    PARTIAL_BLOCK,
    KvCacheAwareRouter,
    LoadBalancingRouter,
    RoundRobinRouter,
    RouteRequest,
    block_hashes,
    make_router,
)
from serving.disagg_router.service import DisaggService, needs_context
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.kv_events import KvEventBuffer
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.helpers import serving
from tests.llm_client.test_routing_pd_aware import words

TIME_SCALE = 0.01
YAML = Path(__file__).resolve().parents[2] / "serving" / "trtllm" / "disagg" / "disagg_config.yaml"
EVENTS = {"kv_event_buffer_max_size": 10_000}


# --- the YAML -----------------------------------------------------------------------------------------


def test_the_production_yaml_loads_with_its_routers_and_conditional_rule() -> None:
    config = DisaggConfig.load(YAML)
    assert len(config.context_servers.urls) == config.context_servers.num_instances == 12
    ctx, gen = config.context_servers.router_settings(), config.generation_servers.router_settings()
    assert (ctx.type, ctx.tokens_per_block, ctx.max_batch_size) == ("kv_cache_aware", 32, 16)
    assert (gen.type, gen.tokens_per_block, gen.max_batch_size) == ("kv_cache_aware", 32, 256)
    assert config.conditional_disagg_config == ConditionalDisagg(max_local_prefill_length=512)
    assert config.context_servers.base_urls()[0] == "http://gpu-node-a:8001"
    pointed = config.with_overrides(context_urls=["http://c0"], generation_urls=["http://g0", "http://g1"])
    assert pointed.context_servers.urls == ["http://c0"] and pointed.generation_servers.num_instances == 2


def test_router_settings_are_built_as_tensorrt_llm_extracts_them() -> None:
    """Pool-level max_batch_size wins over the router block's; kv_cache_config gives tokens_per_block."""
    config = DisaggConfig.model_validate(
        {
            "context_servers": {
                "urls": ["a:1"],
                "max_batch_size": 8,
                "kv_cache_config": {"tokens_per_block": 64},
                "router": {"type": "kv_cache_aware", "max_batch_size": 99},
            },
            "generation_servers": {"urls": ["b:1"], "router": {"type": "load_balancing", "use_tokens": True}},
        }
    )
    assert config.context_servers.router_settings() == RouterSettings(
        type="kv_cache_aware", max_batch_size=8, tokens_per_block=64
    )
    assert isinstance(make_router(config.generation_servers.router_settings(), ["b"]), LoadBalancingRouter)
    assert config.perf_metrics_max_requests == 0 and config.max_retries == 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"context_servers": {"num_instances": 2, "urls": ["a:1"]}}, "number of instances"),
        ({"conditional_disagg_config": {"max_local_prefill_length": 1}}, "KvCacheAwareRouter"),
    ],
)
def test_configs_trtllm_serve_refuses_are_refused(change: dict[str, Any], reason: str) -> None:
    document = {"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]}, **change}
    with pytest.raises(ValueError, match=reason):
        DisaggConfig.model_validate(document)


def test_an_unreadable_config_names_its_file() -> None:
    with pytest.raises(ConfigurationError, match=r"missing\.yaml"):
        DisaggConfig.load(YAML.with_name("missing.yaml"))


# --- the routers, pure -------------------------------------------------------------------------------


def test_block_hashes_leave_out_the_last_token_and_keep_a_partial_block() -> None:
    """TensorRT-LLM hashes blocks of tokens[:-1], the last one partial."""
    for n in (1, 2, 32, 33, 34, 64, 65, 650):
        hashes = block_hashes(RouteRequest(list(range(n))), 32)
        assert len(hashes) == math.ceil((n - 1) / 32), n
        full = engine_block_hashes(list(range(n - 1)), 32)
        assert hashes[: len(full)] == full
        assert hashes[len(full) :] == ([PARTIAL_BLOCK] if (n - 1) % 32 else [])


def test_kv_cache_aware_score_is_tensorrt_llms_formula_on_a_hand_built_block_table() -> None:
    """score = matched_tokens / padded_tokens - active_requests / max_batch_size, per server
    (``KvCacheAwareRouter.get_next_server``); the highest wins."""
    request = RouteRequest(list(range(1000, 1650)))  # 650 tokens: 20 full blocks of 649 keyed + 1 partial
    hashes = block_hashes(request, 32)
    assert len(hashes) == 21 and hashes[-1] == PARTIAL_BLOCK
    router = KvCacheAwareRouter(["a", "b", "c", "d", "e"], max_batch_size=4, tokens_per_block=32)
    router.block_tables.update(
        a=set(hashes[:2]),
        b=set(hashes[:5]),
        c=set(),
        d=set(hashes[1:8]),  # blocks 2-8, not the first: a prefix match stops at once
        e=set(hashes[:20]),  # every full block; nobody holds the partial one
    )
    for server, active in {"b": 3, "e": 2}.items():
        router.table.loads[server].active_requests = active
    padded = 21 * 32
    expected = {
        "a": (64, 64 / padded - 0 / 4),
        "b": (160, 160 / padded - 3 / 4),
        "c": (0, 0.0),
        "d": (0, 0.0),
        "e": (640, 640 / padded - 2 / 4),
    }
    scored = {s.server: (s.matched_tokens, s.score) for s in router.scores(hashes)}
    assert scored.keys() == expected.keys()
    for server, (matched, score) in expected.items():
        assert scored[server][0] == matched, server
        assert scored[server][1] == pytest.approx(score), server

    routed = router.choose(request)
    assert (routed.server, routed.matched_tokens, routed.prompt_tokens) == ("e", 640, 650)
    assert router.table.loads["e"].active_requests == 3, "the pick is reserved"
    # e: 640/672 - 3/4 = 0.202 now, a: 0.095: e still wins; excluding e, a does
    assert router.choose(request, exclude="e").server == "a"
    router.finish(routed)
    assert router.table.loads["e"].active_requests == 2


def test_kv_cache_aware_ties_take_turns() -> None:
    router = KvCacheAwareRouter(["x", "y", "z"], max_batch_size=4)
    router.table.loads["z"].active_requests = 1
    picks = []
    for _ in range(4):
        routed = router.choose(RouteRequest(list(range(100))))
        picks.append(routed.server)
        router.finish(routed)
    assert picks == ["x", "y", "x", "y"], "x and y tie at 0 - 0; z is loaded"


def test_kv_cache_aware_learns_blocks_from_the_simulators_events() -> None:
    """``stored`` adds, ``removed`` drops; ``created`` and ``cleared`` change nothing (TensorRT-LLM
    ignores both), in the simulator's wire format."""
    buffer = KvEventBuffer(100, window_size=1024, capacity_blocks=32)
    buffer.stored(None, [11, 12, 13], [[1], [2], [3]])
    buffer.removed([11])
    buffer.cleared()
    buffer.stored(13, [14], [[4]])
    router = KvCacheAwareRouter(["s"])
    router.block_tables["s"].add(99)
    router.apply_events("s", buffer.drain())
    assert router.block_tables["s"] == {12, 13, 14, 99}
    router.apply_events("unknown", [{"data": {"type": "stored", "blocks": [{"block_hash": 1}]}}])
    assert "unknown" not in router.block_tables


def test_backfill_adds_the_routed_blocks_on_success_only() -> None:
    router = KvCacheAwareRouter(["s"], backfill_block_hashes_on_finish=True)
    request = RouteRequest(list(range(100)))
    router.finish(router.choose(request), success=False)
    assert router.block_tables["s"] == set()
    router.finish(router.choose(request))
    assert router.block_tables["s"] == set(block_hashes(request, 32))


def test_load_balancing_picks_the_least_loaded_and_takes_turns_on_ties() -> None:
    router = LoadBalancingRouter(["a", "b", "c"])
    first = [router.choose(RouteRequest([1])) for _ in range(3)]
    # one counter over every pick: tied [a, b, c] at 0 -> a, tied [b, c] at 1 -> c, [b] at 2 -> b
    assert [r.server for r in first] == ["a", "c", "b"]
    router.finish(first[2])
    assert router.choose(RouteRequest([1])).server == "b", "b is the only server with no request"
    with pytest.raises(NoServerAvailable):
        LoadBalancingRouter(["a"]).choose(RouteRequest([1]), exclude="a")


def test_load_balancing_with_tokens_counts_as_tensorrt_llm_does() -> None:
    """A completion's prompt length (characters of a string prompt); a chat request or a
    generation_only one makes the router raise, as TensorRT-LLM's does."""
    router = LoadBalancingRouter(["a", "b"], use_tokens=True)
    long = router.choose(RouteRequest([1], completion_prompt_length=500))
    short = router.choose(RouteRequest([1], completion_prompt_length=20))
    assert (long.server, short.server) == ("a", "b")
    assert router.choose(RouteRequest([1], completion_prompt_length=10)).server == "b"
    assert router.table.loads["b"].active_tokens == 30
    router.finish(long)
    assert router.table.loads["a"].active_tokens == 0
    with pytest.raises(RouterRefusal, match="ChatCompletionRequest"):
        router.choose(RouteRequest([1]))
    with pytest.raises(RouterRefusal, match="generation_only"):
        router.choose(RouteRequest([1], completion_prompt_length=5, request_type="generation_only"))


def test_round_robin_skips_the_excluded_server_once() -> None:
    router = RoundRobinRouter(["a", "b"])
    assert [router.choose(RouteRequest([1]), exclude="a").server for _ in range(3)] == ["b", "b", "b"]
    with pytest.raises(NoServerAvailable):
        RoundRobinRouter(["a"]).choose(RouteRequest([1]), exclude="a")


@pytest.mark.parametrize(
    ("matched", "prompt", "remote"),
    [(2488, 3000, False), (2487, 3000, True), (0, 100, True), (3000, 3000, False)],
)
def test_the_conditional_rule(matched: int, prompt: int, remote: bool) -> None:
    """Remote when nothing matched or more than max_local_prefill_length (512) is uncached."""
    assert needs_context(matched, prompt, 512) is remote


# --- over HTTP, against simulator replicas --------------------------------------------------------------


@asynccontextmanager
async def stand_in(
    ctx: RunningSimulator, gen: RunningSimulator, **changes: Any
) -> AsyncIterator[tuple[str, DisaggService]]:
    """The production YAML pointed at ``ctx`` and ``gen``, served on a free port."""
    changes = {"perf_metrics_max_requests": 100, **changes}
    config = DisaggConfig.load(YAML).with_overrides(
        context_urls=[ctx.url], generation_urls=[gen.url], **changes
    )
    app = create_app(config, retry_interval_s=0.05)
    async with serving(app) as url:
        yield url, app[SERVICE]


def chat_body(text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 20, "stream": stream}


async def chat_stream(http: aiohttp.ClientSession, url: str, text: str) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=chat_body(text, stream=True)) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return (await response.read()).decode()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_a_cold_prompt_goes_context_only_then_generation_only_and_streams() -> None:
    async with (
        running_simulator(role="context", time_scale=TIME_SCALE, **EVENTS) as ctx,
        running_simulator(role="generation", time_scale=TIME_SCALE, **EVENTS) as gen,
        stand_in(ctx, gen) as (url, service),
        aiohttp.ClientSession() as http,
    ):
        streamed = await chat_stream(http, url, words(3000))
        assert streamed.count("data: {") >= 2 and streamed.rstrip().endswith("data: [DONE]")
        counters = service.counters
        assert (counters.context_requests, counters.generation_requests, counters.local_prefills) == (1, 1, 0)
        assert (ctx.replica.engine.stats.served, gen.replica.engine.stats.served) == (1, 1)

        (record,) = await get_json(http, f"{url}/perf_metrics")
        ctx_record, gen_record = record["ctx_perf_metrics"], record["gen_perf_metrics"]
        assert ctx_record["request_type"] == "context_only"
        assert gen_record["request_type"] == "generation_only"
        assert ctx_record["ctx_request_id"] == gen_record["ctx_request_id"] == record["ctx_request_id"]
        assert (record["ctx_server"], record["gen_server"]) == (ctx.url, gen.url)
        assert gen_record["simulator"]["transferred_blocks"] > 0

        # the servers' clock (simulated seconds): context + transfer <= first token <= last token
        timing = record["timing"]
        assert timing["context_time"] > 0 and timing["transfer_time"] > 0
        assert timing["context_time"] + timing["transfer_time"] <= timing["first_token_time"] + 1e-9
        assert timing["first_token_time"] < timing["last_token_time"]
        # ... and says what each server measured of its part (their own durations, simulated ms)
        ctx_sim, gen_sim = ctx_record["simulator"], gen_record["simulator"]
        assert timing["context_time"] == pytest.approx(ctx_sim["ttft_ms"] / 1000, abs=1e-5)
        assert timing["transfer_time"] == pytest.approx(gen_sim["transfer_wall_ms"] / 1000, abs=1e-5)
        first = (ctx_sim["ttft_ms"] + gen_sim["ttft_ms"]) / 1000
        assert timing["first_token_time"] == pytest.approx(first, abs=1e-5)
        last = (ctx_sim["ttft_ms"] + gen_sim["e2e_ms"]) / 1000
        assert timing["last_token_time"] == pytest.approx(last, abs=1e-5)
        # the front end's clock (wall seconds) orders the same steps, and holds the servers' spans
        wall = [
            record[f"disagg_server_{step}_time"]
            for step in ("arrival", "ctx_dispatch", "ctx_done", "first_token", "last_token")
        ]
        assert wall == sorted(wall)
        ctx_window = record["disagg_server_ctx_done_time"] - record["disagg_server_ctx_dispatch_time"]
        assert timing["context_time"] * TIME_SCALE <= ctx_window + 1e-3
        assert await get_json(http, f"{url}/perf_metrics") == [], "drained, as trtllm-serve's"


@pytest.mark.parametrize(("uncached", "remote"), [(512, False), (513, True)])
async def test_the_conditional_rule_at_its_boundary(uncached: int, remote: bool) -> None:
    """A shopper's next prompt, with exactly 512 (local) or 513 (remote) tokens its generation server
    lacks, counted by the generation replica's own cache, not by the stand-in."""
    history = words(3000)
    async with (
        running_simulator(role="context", time_scale=0.0, **EVENTS) as ctx,
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as gen,
        stand_in(ctx, gen) as (url, service),
        aiohttp.ClientSession() as http,
    ):
        await chat_stream(http, url, history)  # cold: remote; the generation replica keeps its blocks
        assert service.counters.context_requests == 1
        await get_json(http, f"{gen.url}/perf_metrics")

        def uncached_on_gen(text: str) -> tuple[int, int]:
            ids = token_ids(messages_text([{"role": "user", "content": text}]))
            held = gen.replica.cache.longest_prefix(engine_block_hashes(ids, 32))
            return len(ids) - 32 * held, held

        probe, held = uncached_on_gen(history + " x" * 600)  # " x" is one token
        assert held > 0
        text = history + " x" * (600 + uncached - probe)
        assert uncached_on_gen(text) == (uncached, held)

        async with http.post(f"{url}/v1/chat/completions", json=chat_body(text, stream=False)) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["choices"][0]["message"]["content"]
        assert service.counters.context_requests == (2 if remote else 1)
        assert service.counters.local_prefills == (0 if remote else 1)
        assert ctx.replica.engine.stats.served == (2 if remote else 1)
        (gen_record,) = await get_json(http, f"{gen.url}/perf_metrics")
        assert gen_record["request_type"] == ("generation_only" if remote else "context_and_generation")
        assert gen_record["simulator"]["cached_tokens"] == 32 * held, "the shopper's blocks were reused"


async def test_without_conditional_disaggregation_every_prompt_goes_to_a_context_server() -> None:
    history = words(2000)
    async with (
        running_simulator(role="context", time_scale=0.0, **EVENTS) as ctx,
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as gen,
        stand_in(ctx, gen, conditional_disagg_config=None, perf_metrics_max_requests=0) as (url, service),
        aiohttp.ClientSession() as http,
    ):
        await chat_stream(http, url, history)
        await chat_stream(http, url, history + words(100, "new"))
        assert (service.counters.context_requests, service.counters.local_prefills) == (2, 0)
        assert await get_json(http, f"{url}/perf_metrics") == [], "perf_metrics_max_requests 0: none kept"
        health = await get_json(http, f"{url}/health")
        assert health["generation_requests"] == 2 and health["errors"] == 0


async def test_a_context_server_that_refuses_ends_the_request_with_500_and_frees_both_routers() -> None:
    """A "context" server that is really a generation replica answers context_only with 400: the
    stand-in answers 500 (as trtllm-serve does; a worker's 4xx is not retried) and every load
    returns to zero, including the generation server reserved first."""
    async with (
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as wrong,
        running_simulator(role="generation", time_scale=0.0, **EVENTS) as gen,
        stand_in(wrong, gen) as (url, service),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/v1/chat/completions", json=chat_body(words(400), stream=True)) as r:
            assert r.status == 500
            assert "answered 400" in (await r.json())["detail"]
        for router in (service.context_router, service.generation_router):
            assert isinstance(router, KvCacheAwareRouter)
            assert all(load.active_requests == 0 for load in router.table.loads.values())
        assert service.counters.errors == 1 and wrong.replica.engine.stats.served == 0
        async with http.post(f"{url}/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 400
