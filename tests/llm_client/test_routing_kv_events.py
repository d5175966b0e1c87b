"""KV cache events over real HTTP: the simulator publishes them in TensorRT-LLM's format at
``POST /kv_cache_events`` (the engine's own block hashes, each block's token ids), and
``prefix_aware``'s precise mode follows them, rebuilding its own hashes from the tokens (stored,
removed, cleared, a restarted replica, a gap in the event ids, a replica with events off). The pure
parts (attention windows, blocks that cannot be rebuilt) are tested on hand-written events.

Every HTTP test starts its own simulator processes (``serving.simulator.launch``) and stops them at the
end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from devstack.processes import free_port
from devstack.served_process import start_served
from llm_client import ClientConfig, LLMClient
from llm_client.endpoints import Endpoint
from llm_client.kv_events import KvCacheEvent, parse_events
from llm_client.routing.base import RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from prompt_assembly.tokens import chained_block_hashes, count_tokens, messages_text, token_ids
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.launch import SimulatorFleet, simulator_argv
from serving.simulator.testing import running_simulator
from tests.helpers import serving, until, viewed_prompt

FAST = ("--time-scale", "0.002")


def prompt(shopper: str, events: int) -> list[dict[str, str]]:
    return viewed_prompt(shopper, events, item="lantern", category="Garden > Lights")


def ids(shopper: str, events: int) -> list[int]:
    return token_ids(messages_text(prompt(shopper, events)))


def hashes(shopper: str, events: int) -> list[int]:
    """The router's hashes of a prompt."""
    return chained_block_hashes(ids(shopper, events), 32)


def engine_hashes(shopper: str, events: int) -> list[int]:
    """The simulated engine's hashes of the same prompt (what its events carry)."""
    return engine_block_hashes(ids(shopper, events), 32)


def route(shopper: str, events: int) -> RouteRequest:
    text = messages_text(prompt(shopper, events))
    return RouteRequest(shopper, text, count_tokens(text), 8)


async def poll(http: aiohttp.ClientSession, url: str) -> list[KvCacheEvent]:
    async with http.post(url + "/kv_cache_events") as response:
        assert response.status == 200
        return parse_events(await response.read())


async def chat(http: aiohttp.ClientSession, url: str, shopper: str, events: int) -> dict[str, object]:
    body = {"model": "m", "messages": prompt(shopper, events), "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        return dict(await response.json())


def precise_config(urls: list[str], **settings: object) -> ClientConfig:
    return ClientConfig.model_validate(
        {
            "endpoints": urls,
            "policy": "prefix_aware",
            "policy_settings": {"policy": "prefix_aware", "kv_events": "precise", **settings},
            # Generous: on a loaded machine a slow connect must not eject the one replica (an ejected
            # replica's cache knowledge is forgotten, which is not what these tests are about).
            "timeouts": {"connect_s": 5, "attempt_s": 20, "deadline_s": 40},
            "health": {"interval_s": 0.2},
        }
    )


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_simulator_publishes_stored_removed_and_cleared(http: aiohttp.ClientSession) -> None:
    args = (*FAST, "--kv-event-buffer-max-size", "1000", "--cache-capacity-blocks", "200")
    async with SimulatorFleet(1, *args) as fleet:
        url = fleet.urls[0]
        first = await poll(http, url)
        assert [e.data.type for e in first] == ["created"] and first[0].event_id == 0

        assert first[0].window_size == 32768  # the attention window (max_seq_len), not the cache size

        await chat(http, url, "ann", 40)
        stored = await poll(http, url)
        expected = engine_hashes("ann", 40)
        assert [e.data.type for e in stored] == ["stored"] and stored[0].event_id == 1
        data = stored[0].data
        assert data.type == "stored" and data.parent_hash is None
        assert [b.block_hash for b in data.blocks] == expected  # the engine's hashes...
        assert not set(expected) & set(hashes("ann", 40))  # ...which are not the router's
        prompt_ids = ids("ann", 40)
        assert [[t.token_id for t in b.tokens] for b in data.blocks] == [
            prompt_ids[i * 32 : (i + 1) * 32] for i in range(len(expected))
        ]

        # The next prompt of the same shopper stores only its new blocks, chained to the held ones.
        await chat(http, url, "ann", 44)
        grown = engine_hashes("ann", 44)
        held = len([h for h in grown if h in set(expected)])
        (event,) = await poll(http, url)
        assert event.data.type == "stored" and event.data.parent_hash == grown[held - 1]
        assert [b.block_hash for b in event.data.blocks] == grown[held:]
        assert await poll(http, url) == []  # a poll drains: each event is read once

        # Other shoppers overflow the 200 blocks: the least recently used blocks are reported removed.
        for shopper in ("bob", "cat", "dan"):
            await chat(http, url, shopper, 40)
        events = await poll(http, url)
        removed = [h for e in events if e.data.type == "removed" for h in e.data.block_hashes]
        everything = {h for shopper in ("bob", "cat", "dan") for h in engine_hashes(shopper, 40)}
        assert removed and set(removed) <= everything | set(grown) | set(expected)
        assert not set(removed) & set(engine_hashes("dan", 40))  # the newest prompt is not what goes
        assert [e.event_id for e in events] == list(range(events[0].event_id, events[-1].event_id + 1))

        async with http.post(url + "/admin/reset_cache") as response:
            assert response.status == 200
        assert [e.data.type for e in await poll(http, url)] == ["cleared"]


async def test_events_are_off_by_default() -> None:
    async with (
        SimulatorFleet(1, *FAST) as fleet,
        aiohttp.ClientSession() as http,
        http.post(fleet.urls[0] + "/kv_cache_events") as response,
    ):
        assert response.status == 404


async def test_precise_index_follows_evictions_that_approximate_mode_cannot_see() -> None:
    """A small replica cache and a router index bound set too large (as a misconfigured or unknown
    cache size would be): the approximate index still claims an evicted prompt, the precise one drops
    it. One replica per client, so what each replica evicted is certain."""
    args = (*FAST, "--kv-event-buffer-max-size", "10000", "--cache-capacity-blocks", "300")
    precise = PrefixAwarePolicy(kv_events="precise", max_blocks_per_replica=100_000)
    approximate = PrefixAwarePolicy(max_blocks_per_replica=100_000)
    async with (
        SimulatorFleet(1, *args) as p_fleet,
        SimulatorFleet(1, *args) as a_fleet,
        LLMClient(precise_config(p_fleet.urls), precise) as p_client,
        LLMClient(precise_config(a_fleet.urls), approximate) as a_client,
    ):
        await p_client.wait_until_healthy()
        await a_client.wait_until_healthy()
        assert p_client.kv_events is not None and a_client.kv_events is None
        for client in (p_client, a_client):
            for i in range(8):  # 8 shoppers x ~60 blocks > 300 blocks: s0, the oldest, is evicted
                await client.chat(prompt(f"s{i}", 40), routing_key=f"s{i}", max_tokens=4)
        await p_client.kv_events.poll_once()
        assert precise.stats.kv_blocks_removed > 0
        s0 = route("s0", 40)
        (p_home,), (a_home,) = p_client.endpoints, a_client.endpoints
        assert precise.cached_tokens(s0, p_home) < 0.3 * s0.prompt_tokens  # evicted, and it knows
        assert approximate.cached_tokens(s0, a_home) > 0.9 * s0.prompt_tokens  # still believed held
        again = await p_client.chat(prompt("s0", 40), routing_key="s0", max_tokens=4)
        assert again.cached_tokens < 0.3 * again.prompt_tokens  # the replica agrees
        # precise routing still follows the cache for a shopper whose blocks are held
        later = await p_client.chat(prompt("s7", 42), routing_key="s7", max_tokens=4)
        assert later.cached_tokens > 0.8 * later.prompt_tokens


async def test_precise_index_resyncs_after_a_replica_restart_and_counts_gaps() -> None:
    """A replica process restarted on the same address: its event ids start again from 0 with
    ``created``, and the index of that replica is emptied; a buffer too small for one poll's events
    shows up as a gap in the ids."""
    port = free_port()
    argv = simulator_argv(
        port=port, extra=(*FAST, "--kv-event-buffer-max-size", "3", "--cache-capacity-blocks", "100")
    )
    policy = PrefixAwarePolicy(kv_events="precise", kv_events_poll_s=60)  # the test steps the poller
    replica = await start_served(argv)
    try:
        url = f"http://127.0.0.1:{port}"
        async with LLMClient(precise_config([url]), policy) as client:
            await client.wait_until_healthy()
            assert client.kv_events is not None
            await client.kv_events.poll_once()  # reads ``created``
            home = client.endpoints[0]
            for i in range(4):  # 4 prompts of ~60 blocks in 100: stored and removed events, > 3
                await client.chat(prompt(f"g{i}", 40), routing_key=f"g{i}", max_tokens=4)
            await client.kv_events.poll_once()
            assert policy.stats.kv_gaps == 1  # the buffer kept the newest 3 events only
            assert policy.stats.kv_restarts == 0 and len(policy.index(home)) > 0

            await replica.stop()  # SIGTERM, as an operator restarts it
            replica = await start_served(argv)
            await client.kv_events.poll_once()  # the new process: event 0, ``created``
            assert policy.stats.kv_restarts == 1
            assert len(policy.index(home)) == 0  # nothing is believed held on the restarted replica
            await client.chat(prompt("g9", 40), routing_key="g9", max_tokens=4)
            await client.kv_events.poll_once()
            assert policy.cached_tokens(route("g9", 40), home) > 0
            head_only = policy.cached_tokens(route("g0", 40), home)  # the shared system prompt, no more
            assert head_only < 0.3 * route("g0", 40).prompt_tokens
    finally:
        await replica.stop()


async def test_precise_mode_learns_a_prompt_it_never_routed_from_the_events_tokens(
    http: aiohttp.ClientSession,
) -> None:
    """A prompt that reached the replica by another way (another router, a direct call): the router
    knows of it only from the ``stored`` event, whose block hashes are the engine's. Precise mode
    rebuilds its own hashes from the blocks' tokens and finds the prompt held; a router that indexed
    the engine's hashes would find nothing (its hashes never equal the engine's), and its removal
    follows the engine's ``removed`` event."""
    args = (*FAST, "--kv-event-buffer-max-size", "1000", "--cache-capacity-blocks", "200")
    policy = PrefixAwarePolicy(kv_events="precise", kv_events_poll_s=60)  # the test steps the poller
    async with SimulatorFleet(1, *args) as fleet, LLMClient(precise_config(fleet.urls), policy) as client:
        await client.wait_until_healthy()
        assert client.kv_events is not None
        home = client.endpoints[0]
        await chat(http, fleet.urls[0], "eve", 40)  # not through the client
        assert policy.cached_tokens(route("eve", 40), home) == 0
        await client.kv_events.poll_once()
        eve = route("eve", 40)
        assert policy.cached_tokens(eve, home) == len(hashes("eve", 40)) * 32 > 0.9 * eve.prompt_tokens
        assert policy.index(home).confirmed_prefix(hashes("eve", 40)) == len(hashes("eve", 40))
        assert policy.stats.kv_blocks_unrebuilt == 0
        answer = await client.chat(prompt("eve", 42), routing_key="eve", max_tokens=4)
        assert answer.cached_tokens > 0.8 * answer.prompt_tokens  # the replica agrees

        for shopper in ("fay", "gus", "hal", "ivy"):  # ~60 blocks each in 200: eve's are evicted
            await chat(http, fleet.urls[0], shopper, 40)
        await client.kv_events.poll_once()
        assert policy.stats.kv_blocks_removed > 0
        assert policy.cached_tokens(route("eve", 40), home) < 0.3 * eve.prompt_tokens


def _event(event_id: int, data: dict[str, object], window: int | None = 4096) -> dict[str, object]:
    return {"event_id": event_id, "window_size": window, "data": data}


def _stored(parent: int | None, blocks: list[tuple[int, list[int]]], extra: int = 0) -> dict[str, object]:
    return {
        "type": "stored",
        "parent_hash": parent,
        "blocks": [
            {
                "type": "stored_block",
                "block_hash": h,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in tokens],
                "cache_level": 0,
                "priority": 35,
            }
            for h, tokens in blocks
        ],
    }


def _apply(policy: PrefixAwarePolicy, endpoint: Endpoint, *events: dict[str, object]) -> None:
    policy.apply_kv_events(endpoint, parse_events(json.dumps(list(events)).encode()))


BLOCK_A, BLOCK_B, BLOCK_C = list(range(32)), list(range(100, 132)), list(range(200, 232))


def test_only_the_largest_attention_windows_events_are_followed() -> None:
    """A model with sliding-window layers: one ``created`` per window at start, then events of both
    pools. The sliding window's pool keeps only recent blocks, so its events say nothing about reusable
    prefixes: they are skipped, and the second ``created`` is no restart."""
    policy = PrefixAwarePolicy(kv_events="precise")
    home = Endpoint("http://r0", "r0")
    _apply(
        policy,
        home,
        _event(0, {"type": "created", "num_blocks_per_cache_level": [100, 0]}, window=512),
        _event(1, {"type": "created", "num_blocks_per_cache_level": [900, 0]}, window=32768),
        _event(2, _stored(None, [(7, BLOCK_A)]), window=512),
        _event(3, _stored(None, [(8, BLOCK_A), (9, BLOCK_B)]), window=32768),
        _event(4, {"type": "removed", "block_hashes": [7]}, window=512),
    )
    router = chained_block_hashes(BLOCK_A + BLOCK_B, 32)
    assert policy.index(home).confirmed_prefix(router) == 2
    assert policy.stats.kv_restarts == 0 and policy.stats.kv_events_other_window == 2
    _apply(policy, home, _event(5, {"type": "removed", "block_hashes": [9]}, window=32768))
    assert policy.index(home).confirmed_prefix(router) == 1
    # a ``created`` after blocks were stored is a new engine (ids restarting is the other sign)
    _apply(policy, home, _event(6, {"type": "created", "num_blocks_per_cache_level": [900, 0]}))
    assert policy.stats.kv_restarts == 1 and len(policy.index(home)) == 0


def test_blocks_that_cannot_be_rebuilt_are_not_indexed() -> None:
    """A run whose parent the router never saw stored (events lost in a gap), a partly filled last
    block (trtllm's partial reuse), tokens with extra ids: not indexed, counted. Two engine blocks
    with one router hash (two cache salts) leave the index only when both are removed."""
    policy = PrefixAwarePolicy(kv_events="precise")
    home = Endpoint("http://r0", "r0")
    router = chained_block_hashes(BLOCK_A + BLOCK_B + BLOCK_C, 32)
    _apply(
        policy,
        home,
        _event(0, _stored(None, [(1, BLOCK_A), (2, BLOCK_B), (3, BLOCK_C[:5])])),  # partial last block
        _event(1, _stored(99, [(4, BLOCK_C)])),  # unknown parent
        _event(2, _stored(None, [(5, BLOCK_C)], extra=3)),  # extra ids
        _event(3, _stored(None, [(11, BLOCK_A)])),  # the same tokens under another salt
    )
    index = policy.index(home)
    assert index.confirmed_prefix(router) == 2 and len(index) == 2
    assert policy.stats.kv_blocks_unrebuilt == 3
    _apply(policy, home, _event(4, {"type": "removed", "block_hashes": [2, 1, 3]}))
    assert index.confirmed_prefix(router) == 1  # block A is still held under the other salt
    _apply(policy, home, _event(5, {"type": "removed", "block_hashes": [11]}))
    assert len(index) == 0 and policy.stats.kv_blocks_removed == 2


async def test_a_replica_sending_an_out_of_range_token_id_leaves_the_poller_running() -> None:
    """A token id past 32 bits raised out of the event poller (the router packs ids in 32 bits): the
    poller ended with no log, the fleet's cache picture froze, and the client's ``close`` raised that
    error before it stopped the health loop and closed its session. Such events are unreadable now:
    counted and logged, the poller goes on, and ``close`` closes."""
    BLOCK = PrefixAwarePolicy().block_size  # a whole block: a partial one is not rebuilt at all
    bad_event = {
        "event_id": 1,
        "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"block_hash": 7, "tokens": [{"token_id": 2**32 + i, "token_extra_id": 0} for i in range(BLOCK)]}
        ]},
    }  # fmt: skip

    async def events(request: web.Request) -> web.Response:
        return web.json_response([bad_event])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/kv_cache_events", events)
    app.router.add_get("/health", health)
    async with serving(app) as bad, running_simulator(time_scale=0.0) as good:
        client = LLMClient(precise_config([bad, good.url]))
        await client.__aenter__()
        try:
            await client.wait_until_healthy()
            poller = client.kv_events
            assert poller is not None
            await until(lambda: poller.failed_polls >= 3, within_s=20)
            assert poller._task is not None and not poller._task.done(), "the poller goes on"
        finally:
            await client.close()


async def test_a_replica_that_hangs_does_not_hold_the_other_replicas_event_polls() -> None:
    """Each round of polls waited for every replica's: one replica that stopped answering (a hung GPU,
    a stopped process, still routable until its calls fail) slowed every replica's polls to the poll's
    10 s timeout. Replicas are polled apart now: the healthy one keeps its rate (every 0.25 s)."""
    hanging = asyncio.Event()

    async def events(request: web.Request) -> web.Response:
        await hanging.wait()  # never set: the poll runs into its timeout
        return web.json_response([])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/kv_cache_events", events)
    app.router.add_get("/health", health)
    async with (
        serving(app) as hung,
        running_simulator(time_scale=0.0, kv_event_buffer_max_size=100) as good,
        LLMClient(precise_config([hung, good.url])) as client,
    ):
        try:
            await client.wait_until_healthy()
            poller = client.kv_events
            assert poller is not None
            await asyncio.sleep(2.5)  # ten intervals: a healthy replica's polls, one hung poll at most
            assert poller.polls >= 5, f"{poller.polls} polls in 2.5 s"
        finally:
            hanging.set()  # the stub's handler ends, so its server stops at once
