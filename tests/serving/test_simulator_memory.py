"""KV memory and scheduling as TensorRT-LLM has them, over HTTP.

Each test drives a real replica (``running_simulator``) with prompts of an exact token count and reads
what the replica reports (``/admin/stats``, ``/admin/ttft``, ``usage``). Sizes come from the replica's
own settings (block size, capacity), never from constants of the test.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prompt_assembly.tokens import token_ids
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.config import SimulatorConfig
from serving.simulator.hardware import GPUS, MODELS, kv_memory
from serving.simulator.launch import simulator_argv
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.serving.conftest import post_json

REPO = Path(__file__).resolve().parents[2]


def _prompt(n: int, seed: str) -> str:
    """``n`` tokens exactly (every " abcde" word is one token of the shared tokenizer), unique per seed."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = "".join(" " + "".join(rng.choices(letters, k=rng.randint(3, 7))) for _ in range(n))
    assert len(token_ids(text)) == n
    return text


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def _stats(http: aiohttp.ClientSession, sim: RunningSimulator) -> dict[str, Any]:
    async with http.get(f"{sim.url}/admin/stats") as r:
        body: dict[str, Any] = await r.json()
        return body


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(10.0):
        while not predicate():
            await asyncio.sleep(0.002)


# ---- sizing -----------------------------------------------------------------------------------------
def test_default_cache_is_what_the_card_leaves_after_weights_and_activations() -> None:
    """blocks = 0.9 x (memory - weights - activations) / (KV bytes a token x 32), for the default 32B
    bf16 model on an 80 GB H100; a bigger card or FP8 weights hold more, and an override wins."""
    config = SimulatorConfig()
    kv = config.kv_memory()
    free = kv.gpu_memory_bytes - kv.weight_bytes - kv.activation_bytes
    expected = int(config.free_gpu_memory_fraction * free) // (kv.kv_bytes_per_token * config.block_size)
    assert config.cache_capacity_blocks == kv.blocks == expected
    assert kv.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # Qwen2.5-32B's layers, KV heads, head dim, bf16
    # The old default (8,192 blocks) was several times what the card holds.
    assert (
        kv.blocks * kv.tokens_per_block * kv.kv_bytes_per_token
        < GPUS["h100-80gb"].memory_bytes - kv.weight_bytes
    )
    sizes = {
        (gpu, dtype): kv_memory(
            "qwen2.5-32b",
            gpu,
            dtype,
            "auto",
            free_gpu_memory_fraction=0.9,
            tokens_per_block=32,
            max_num_tokens=config.max_num_tokens,
        ).blocks
        for gpu in GPUS
        for dtype in ("bf16", "fp8")
    }
    assert sizes[("h100-80gb", "bf16")] < sizes[("h100-80gb", "fp8")] < sizes[("h200-141gb", "fp8")]
    assert sizes[("h100-80gb", "bf16")] < sizes[("h200-141gb", "bf16")]
    assert SimulatorConfig(cache_capacity_blocks=100).cache_capacity_blocks == 100
    assert config.max_seq_len == MODELS["qwen2.5-32b"].max_position_embeddings


async def test_start_line_prints_the_kv_memory_sum() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = simulator_argv(
        replica_id="kv", time_scale=0, extra=["--gpu", "h200-141gb", "--weight-dtype", "fp8"]
    )
    proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    expected = SimulatorConfig(gpu="h200-141gb", weight_dtype="fp8").kv_memory()
    assert line["kv_memory"]["blocks"] == line["cache_capacity_blocks"] == expected.blocks
    assert line["kv_memory"]["gpu"] == GPUS["h200-141gb"].name and line["kv_memory"]["kv_dtype"] == "fp8"


# ---- admission and pinned blocks --------------------------------------------------------------------
async def test_guaranteed_no_evict_admits_only_what_fits_with_its_max_tokens(
    http: aiohttp.ClientSession,
) -> None:
    """Two requests whose prompt + max_tokens each need a little over half the cache: under
    GUARANTEED_NO_EVICT (the default) the second waits for the first to finish, while the first holds
    blocks for every token it may generate; under MAX_UTILIZATION both start, and the later one is paused
    when the cache runs out, then finishes. The old simulator (no pins) ran both at once."""
    prompt_tokens, max_tokens, block = 320, 400, 32
    blocks_each = math.ceil((prompt_tokens + max_tokens) / block)
    capacity = 2 * blocks_each - 2
    bodies = [_body(_prompt(prompt_tokens, f"fit-{i}"), max_tokens) for i in range(2)]
    for policy in ("guaranteed_no_evict", "max_utilization"):
        async with running_simulator(
            time_scale=0.001, cache_capacity_blocks=capacity, capacity_policy=policy, max_seq_len=4096
        ) as sim:
            url = f"{sim.url}/v1/completions"
            first = asyncio.create_task(post_json(http, url, bodies[0]))
            await _until(lambda: sim.replica.engine.num_running == 1)
            kv = (await _stats(http, sim))["kv_blocks"]
            if policy == "guaranteed_no_evict":
                # The running request holds its prompt and room for all of its max_tokens.
                assert kv["pinned"] + kv["reserved"] == blocks_each
            second = asyncio.create_task(post_json(http, url, bodies[1]))
            await _until(lambda: sim.replica.engine.num_waiting + sim.replica.engine.num_running == 2)
            await asyncio.sleep(0.05)
            waiting_while_first_runs = sim.replica.engine.num_waiting
            results = await asyncio.gather(first, second)
            stats = await _stats(http, sim)
        assert all(status == 200 for status, _ in results)
        assert all(body["usage"]["completion_tokens"] == max_tokens for _, body in results)
        if policy == "guaranteed_no_evict":
            assert waiting_while_first_runs == 1 and stats["engine"]["paused"] == 0
        else:
            assert stats["engine"]["paused"] >= 1
        assert stats["kv_blocks"]["pinned"] == stats["kv_blocks"]["reserved"] == 0  # all given back


async def test_running_blocks_are_pinned_and_generated_tokens_take_room(http: aiohttp.ClientSession) -> None:
    """While a request runs, its prompt's blocks are pinned (never evicted: a stream of other prompts
    through the rest of the cache leaves them), and the blocks its generated tokens fill count as held."""
    block = SimulatorConfig().block_size
    long_prompt = _prompt(10 * block, "pinned-long")
    hashes = engine_block_hashes(token_ids(long_prompt), block)
    max_tokens = 4 * block
    async with running_simulator(time_scale=0.002, cache_capacity_blocks=3 * len(hashes)) as sim:
        url = f"{sim.url}/v1/completions"
        runner = asyncio.create_task(post_json(http, url, _body(long_prompt, max_tokens)))
        await _until(lambda: sim.replica.engine.num_running == 1 and sim.replica.cache.pinned_blocks > 0)
        kv = (await _stats(http, sim))["kv_blocks"]
        assert kv["pinned"] == len(hashes)
        assert kv["reserved"] == math.ceil((10 * block + max_tokens) / block) - len(hashes)
        for i in range(6):  # enough other prompts to evict everything unpinned several times over
            status, _ = await post_json(http, url, _body(_prompt(len(hashes) * block, f"churn-{i}"), 1))
            assert status == 200
        assert sim.replica.cache.longest_prefix(hashes) == len(hashes)
        assert all(sim.replica.cache.is_pinned(h) for h in hashes)
        status, _ = await runner
    assert status == 200


# ---- scheduler --------------------------------------------------------------------------------------
async def test_a_prompt_over_max_num_tokens_or_max_seq_len_is_refused(http: aiohttp.ClientSession) -> None:
    """trtllm-serve answers 400 for a prompt larger than one iteration's token budget (prefill not
    chunked), and for prompt + max_tokens beyond max_seq_len; the simulator once ran such a prompt alone."""
    budget = 256
    async with (
        running_simulator(time_scale=0.0, max_num_tokens=budget, max_seq_len=4 * budget) as sim,
        running_simulator(
            time_scale=0.0, max_num_tokens=budget, max_seq_len=4 * budget, enable_chunked_prefill=True
        ) as chunked,
    ):
        over = _body(_prompt(budget + 1, "over"), 4)
        status, body = await post_json(http, f"{sim.url}/v1/completions", over)
        assert status == 400 and "max_num_tokens" in body["error"]["message"]
        status, _ = await post_json(http, f"{chunked.url}/v1/completions", over)
        assert status == 200  # chunked prefill splits it instead
        too_long = _body(_prompt(budget, "seq"), 3 * budget + 1)
        for replica in (sim, chunked):
            status, body = await post_json(http, f"{replica.url}/v1/completions", too_long)
            assert status == 400 and "max_seq_len" in body["error"]["message"]
        status, _ = await post_json(http, f"{sim.url}/v1/completions", _body(_prompt(budget, "fits"), 4))
        assert status == 200
        assert sim.replica.engine.stats.served == 1


async def test_a_prompt_reusing_cached_blocks_still_counts_whole_against_the_budget(
    http: aiohttp.ClientSession,
) -> None:
    """Without chunked prefill the whole prompt counts against max_num_tokens, reused tokens too: two
    warm prompts that together exceed the budget are prefilled in separate iterations. Over HTTP the
    two need not reach the same admission, so this is the end-to-end check only; the admission itself
    (whole prompts charged, not their uncached tokens) is checked in ``test_simulator_engine.py``
    (``test_a_prompt_reusing_cached_blocks_still_counts_whole_against_the_token_budget``)."""
    budget, block = 512, 32
    shared = _prompt(300, "shared")
    bodies = [_body(shared + _prompt(block, f"tail-{i}"), 1) for i in range(2)]
    async with running_simulator(time_scale=0.0, max_num_tokens=budget) as sim:
        url = f"{sim.url}/v1/completions"
        status, _ = await post_json(http, url, _body(shared, 1))  # warm the shared prefix
        assert status == 200
        before = sim.replica.engine.stats.iterations
        replies = await asyncio.gather(*(post_json(http, url, b) for b in bodies))
        iterations = sim.replica.engine.stats.iterations - before
    assert all(
        status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for status, body in replies
    )
    assert sum(body["usage"]["prompt_tokens"] for _, body in replies) > budget
    assert iterations == 2


async def test_a_client_that_leaves_frees_its_slot_at_the_next_poll_and_keeps_its_blocks(
    http: aiohttp.ClientSession,
) -> None:
    """trtllm-serve polls ``is_disconnected()`` once a second: the engine notices a vanished client at
    the next poll, aborts the request (its batch slot and held blocks are freed), and the prompt's blocks
    it computed stay in the cache for the shopper's next request."""
    block = SimulatorConfig().block_size
    prompt = _prompt(8 * block, "leaver")
    hashes = engine_block_hashes(token_ids(prompt), block)
    async with running_simulator(time_scale=0.01, disconnect_poll_s=1.0) as sim:
        url = f"{sim.url}/v1/completions"
        leaver = asyncio.create_task(post_json(http, url, _body(prompt, 2000)))
        await _until(lambda: sim.replica.engine.stats.decode_tokens > 0)
        leaver.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await leaver
        await _until(lambda: sim.replica.engine.num_running == 0)
        stats = await _stats(http, sim)
        assert stats["engine"]["aborted"] == 1 and stats["engine"]["served"] == 0
        assert stats["kv_blocks"]["pinned"] == stats["kv_blocks"]["reserved"] == 0
        assert sim.replica.cache.longest_prefix(hashes) == len(hashes)
        status, body = await post_json(http, url, _body(prompt, 1))
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hashes) * block - (
        1 if len(hashes) * block == len(token_ids(prompt)) else 0
    )


async def test_a_continuing_prompt_reuses_the_partly_filled_last_block(http: aiohttp.ClientSession) -> None:
    """TensorRT-LLM reuses the matching leading tokens of a partly filled block (``enable_partial_reuse``,
    on by default): a shopper's next prompt, which continues the previous one, reuses all of it, not only
    its whole blocks. Off, the tokens after the last whole block are computed again."""
    block = SimulatorConfig().block_size
    first = _prompt(5 * block + block // 2, "partial-first")
    second = first + _prompt(2 * block, "partial-more")
    cached: dict[bool, int] = {}
    for partial in (True, False):
        async with running_simulator(time_scale=0.0, enable_partial_reuse=partial) as sim:
            url = f"{sim.url}/v1/completions"
            status, _ = await post_json(http, url, _body(first, 1))
            assert status == 200
            status, body = await post_json(http, url, _body(second, 1))
            assert status == 200
            cached[partial] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached[True] == len(token_ids(first))
    assert cached[False] == len(token_ids(first)) // block * block


async def test_a_request_without_max_tokens_books_the_rest_of_max_seq_len(
    http: aiohttp.ClientSession,
) -> None:
    """TensorRT-LLM deduces a missing ``max_tokens`` as ``max_seq_len - prompt``, and GUARANTEED_NO_EVICT
    books blocks for all of it: a request that sets none holds that much KV memory while it runs."""
    block, prompt_tokens, max_seq_len = SimulatorConfig().block_size, 100, 2048
    async with running_simulator(time_scale=0.002, max_seq_len=max_seq_len) as sim:
        url = f"{sim.url}/v1/completions"
        body = {"prompt": _prompt(prompt_tokens, "no-max"), "ignore_eos": True}
        request = asyncio.create_task(post_json(http, url, body))
        await _until(lambda: sim.replica.engine.num_running == 1 and sim.replica.cache.pinned_blocks > 0)
        kv = (await _stats(http, sim))["kv_blocks"]
        status, reply = await request
    assert kv["pinned"] + kv["reserved"] == max_seq_len // block  # the whole max_seq_len, in blocks
    assert status == 200 and reply["usage"]["completion_tokens"] == SimulatorConfig().default_max_tokens
