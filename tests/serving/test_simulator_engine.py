"""The iteration scheduler batches continuously, respects its limits, and idles without a task."""

from __future__ import annotations

import asyncio

from serving.simulator.config import SimulatorConfig
from serving.simulator.cost_model import CostModel
from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, EngineLimits, GenerationRequest
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
    assert expected * 0.9 < loop.time() - start < expected + 0.05
