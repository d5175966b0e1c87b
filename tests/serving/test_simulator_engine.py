"""The iteration scheduler batches continuously, respects its limits, and idles without a task."""

from __future__ import annotations

import asyncio

from serving.simulator.config import SimulatorConfig
from serving.simulator.cost_model import CostModel
from serving.simulator.engine import (
    ChunkingPolicy,
    ContinuousBatchingEngine,
    EngineKnobs,
    EngineLimits,
    GenerationRequest,
)
from serving.simulator.prefix_cache import BlockPrefixCache

COST = CostModel.from_calibration(SimulatorConfig().resolved_calibration_path(), "qwen2.5-32b")


def _engine(
    max_batch: int = 64, max_num_tokens: int = 8192, time_scale: float = 0.0
) -> ContinuousBatchingEngine:
    return ContinuousBatchingEngine(
        COST,
        BlockPrefixCache(1000, 32),
        EngineLimits(max_batch=max_batch, max_num_tokens=max_num_tokens),
        EngineKnobs(time_scale=time_scale),
    )


def _request(n: int, tokens: int = 10, prompt: int = 100) -> GenerationRequest:
    return GenerationRequest(f"r{n}", prompt, [n * 1000 + i for i in range(prompt // 32)], tokens)


async def _run_all(engine: ContinuousBatchingEngine, requests: list[GenerationRequest]) -> None:
    for r in requests:
        engine.submit(r)
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in requests)), 10)


async def test_concurrent_requests_share_decode_iterations() -> None:
    engine = _engine()
    requests = [_request(i) for i in range(8)]
    await _run_all(engine, requests)
    # One iteration prefills all eight and gives each its first token; nine more finish them.
    assert engine.stats.iterations == 10
    assert all(r.tokens_done == 10 and len(r.token_times) == 10 for r in requests)
    assert engine.stats.served == 8


async def test_max_batch_limits_the_running_set() -> None:
    engine = _engine(max_batch=2)
    await _run_all(engine, [_request(i) for i in range(4)])
    assert engine.stats.iterations == 20


async def test_token_budget_splits_prefills_across_iterations() -> None:
    engine = _engine(max_num_tokens=250)
    requests = [_request(i, tokens=1, prompt=200) for i in range(3)]
    await _run_all(engine, requests)
    assert engine.stats.iterations == 3
    assert engine.stats.prefill_tokens_computed == 600


async def test_a_prompt_reusing_cached_blocks_still_counts_whole_against_the_token_budget() -> None:
    """Without chunked prefill the whole prompt counts against max_num_tokens, its reused tokens too
    (TensorRT-LLM charges them): two warm prompts that together exceed the budget are prefilled in
    separate iterations, although their uncached tokens alone would fit one."""
    engine = _engine(max_num_tokens=512)
    shared = [7_000 + i for i in range(9)]  # nine blocks of 32 tokens
    await _run_all(engine, [GenerationRequest("warm", 9 * 32, shared, 1)])
    before = engine.stats.iterations
    # 332 tokens: the nine shared blocks, one block of its own and 12 tokens more.
    prompts = [GenerationRequest(f"p{i}", 332, [*shared, 8_000 + i], 1) for i in range(2)]
    await _run_all(engine, prompts)
    assert all(p.cached_tokens > 0 for p in prompts)
    assert (
        sum(p.prompt_tokens - p.cached_tokens for p in prompts) <= 512 < sum(p.prompt_tokens for p in prompts)
    )
    assert engine.stats.iterations - before == 2


async def test_loop_task_exists_only_while_there_is_work() -> None:
    engine = _engine()
    await _run_all(engine, [_request(0)])
    await asyncio.sleep(0)
    assert engine._task is None


async def test_abort_releases_the_waiter_and_frees_the_slot() -> None:
    engine = _engine(time_scale=1.0)
    request = _request(0, tokens=1000)
    engine.submit(request)
    await asyncio.sleep(0.01)
    engine.abort(request)
    assert request.done.is_set() and request.cancelled
    await engine.close()


async def test_time_scale_controls_wall_time() -> None:
    engine = _engine(time_scale=0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await _run_all(engine, [_request(0, tokens=1, prompt=4096)])
    expected = COST.prefill_ms(4096) / 1000 * 0.05
    # Ignoring time_scale would take 20x as long (~0.5 s): the upper bound leaves room for a stalled host.
    assert expected * 0.9 < loop.time() - start < expected + 0.25


# ---- chunked prefill --------------------------------------------------------------------------------
def _chunked_engine(
    max_num_tokens: int, policy: ChunkingPolicy = "first_come_first_served", max_batch: int = 64
) -> ContinuousBatchingEngine:
    """Chunked engine whose clock counts iterations, so ``first_token_at`` is an iteration number."""
    holder: list[ContinuousBatchingEngine] = []
    engine = ContinuousBatchingEngine(
        COST,
        BlockPrefixCache(1000, 32),
        EngineLimits(max_batch, max_num_tokens, chunked_prefill=True, chunking_policy=policy, chunk_unit=32),
        EngineKnobs(time_scale=0.0),
        clock=lambda: float(holder[0].stats.iterations),
    )
    holder.append(engine)
    return engine


async def test_chunked_prefill_is_off_by_default() -> None:
    assert EngineLimits(64, 8192).chunked_prefill is False
    assert SimulatorConfig().enable_chunked_prefill is False
    engine = _engine(max_num_tokens=256)
    request = _request(0, tokens=1, prompt=1000)
    await _run_all(engine, [request])
    assert engine.stats.iterations == 1  # admitted alone, whole, over the budget


async def test_chunked_prefill_splits_a_long_prompt_and_costs_each_chunk_on_its_context() -> None:
    engine = _chunked_engine(max_num_tokens=256)
    request = _request(0, tokens=1, prompt=1000)
    await _run_all(engine, [request])
    # 256 + 256 + 256 + 232 tokens: the first token comes with the last chunk.
    assert engine.stats.iterations == 4 and request.first_token_at == 4.0
    assert engine.stats.prefill_tokens_computed == 1000
    expected = sum(COST.prefill_ms(n, done) for n, done in ((256, 0), (256, 256), (256, 512), (232, 768)))
    assert abs(engine.stats.busy_ms - expected) < 1e-6


async def test_decode_tokens_are_scheduled_before_prefill_chunks() -> None:
    engine = _chunked_engine(max_num_tokens=256)
    short = [_request(i, tokens=50, prompt=64) for i in range(4)]
    for r in short:
        engine.submit(r)
    while not all(r.first_token_at is not None for r in short):
        await asyncio.sleep(0)
    before = engine.stats.prefill_tokens_computed
    long = _request(9, tokens=1, prompt=1000)
    engine.submit(long)
    await asyncio.sleep(0)
    while engine.stats.prefill_tokens_computed == before:
        await asyncio.sleep(0)
    # Four decoding requests take four tokens of the budget; the chunk gets the rest, in whole blocks.
    assert engine.stats.prefill_tokens_computed - before == (256 - 4) // 32 * 32
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in [*short, long])), 10)
    assert all(r.tokens_done == r.completion_tokens for r in [*short, long])


async def test_equal_progress_lets_a_short_prompt_pass_a_long_one() -> None:
    first: dict[str, float] = {}
    for policy in ("first_come_first_served", "equal_progress"):
        engine = _chunked_engine(max_num_tokens=512, policy=policy)
        long, short = _request(0, tokens=1, prompt=3000), _request(1, tokens=1, prompt=200)
        await _run_all(engine, [long, short])
        assert engine.stats.prefill_tokens_computed == 3200
        assert short.first_token_at is not None and long.first_token_at is not None
        first[policy] = short.first_token_at
        if policy == "equal_progress":
            assert short.first_token_at < long.first_token_at
    # FCFS: the long prompt takes each iteration's budget until it is done; equal progress: the short
    # one is done in its first iteration, beside a chunk of the long one.
    assert first["equal_progress"] == 1.0 < first["first_come_first_served"]


async def test_chunked_prefill_respects_max_batch_and_reuses_cache() -> None:
    engine = _chunked_engine(max_num_tokens=128, max_batch=2)
    requests = [_request(i, tokens=3, prompt=300) for i in range(3)] + [_request(0, tokens=1, prompt=300)]
    await _run_all(engine, requests)
    assert all(r.done.is_set() and r.error is None for r in requests)
    assert requests[-1].cached_tokens == 9 * 32  # the repeat of prompt 0 found its blocks
    assert engine.stats.prefill_tokens_computed == 3 * 300 + (300 - 9 * 32)


async def test_chunk_blocks_become_reusable_after_each_chunk_only_when_asked() -> None:
    for reuse in (False, True):
        engine = ContinuousBatchingEngine(
            COST,
            BlockPrefixCache(1000, 32),
            EngineLimits(
                64,
                256,
                chunked_prefill=True,
                chunking_policy="equal_progress",
                reuse_chunk_blocks=reuse,
                defer_shared_prefixes=False,  # else the repeat waits for the whole first prompt
            ),
            EngineKnobs(time_scale=0.0),
        )
        first = _request(0, tokens=1, prompt=1000)
        engine.submit(first)
        while engine.stats.prefill_tokens_computed < 256:
            await asyncio.sleep(0)
        # The same prompt again, admitted (equal progress) between the first one's first and second chunk.
        again = _request(0, tokens=1, prompt=1000)
        await _run_all(engine, [again])
        await first.done.wait()
        assert again.cached_tokens == (256 if reuse else 0)
