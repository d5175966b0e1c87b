"""The batch pool's adaptive limit against real replicas: what it backs off from, and how it follows the
pool's size when capacity shifting moves replicas."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from batch.admin import submit_job
from batch.aimd import AimdController, AimdSettings
from batch.cli import wait_for_first_replica
from batch.launch import batch_client_config, open_batch
from batch.pool import EndpointPool
from batch.synthetic import synthetic_product_lines
from devstack.processes import free_port
from llm_client.client import LLMClient
from llm_client.errors import NoHealthyEndpoint
from serving.simulator.testing import running_simulator
from tests.batch.test_batch_job import _run, _settings, _upload
from tests.conftest import Isolated


async def test_invalid_answers_do_not_cut_the_limit(isolated: Isolated) -> None:
    # One answer in twenty is a well-formed refusal, which the client tries once more on another
    # replica: the request's fault, not the fleet's load. Counted as errors (each failover a retry,
    # each record written off a failed call), every window over 2% cut the limit by 30%, and three idle
    # replicas served a sixth of what they could.
    settings = _settings(shard_records=100)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    lines = list(synthetic_product_lines(3000, seed=3, long_share=0.0, bad_share=0.0))
    faults = {"bad_answer": "not_understanding", "bad_answer_rate": 0.05}
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(running_simulator(time_scale=0.02, seed=i, **faults))
            for i in range(3)
        ]
        llm = batch_client_config(
            [s.url for s in sims], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2}
        )
        runtime = await stack.enter_async_context(open_batch(settings, sinks, llm))
        await _upload(runtime.store, f"{base}/in.jsonl", lines)
        job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
        final = (await _run(runtime, [job.job_id]))[job.job_id]
        decisions = list(runtime.pool.decisions)
        failovers = runtime.pool.client.failovers
    assert final.state == "succeeded", final
    assert failovers > 0, "no answer was invalid: the test shows nothing"
    cuts = [reason for _, _, reason in decisions if reason.startswith("errors")]
    assert cuts == [], f"{len(cuts)} of {len(decisions)} decisions cut the limit for errors: {cuts[:3]}"


@pytest.mark.parametrize(("replicas", "to", "expected"), [(3, 1, 100), (1, 3, 300), (3, 0, 100)])
async def test_a_pool_resized_moves_its_limit_in_proportion(replicas: int, to: int, expected: int) -> None:
    # Before, the new budget capped the limit first and then it was scaled: 3 -> 1 replica took a
    # limit of 300 to 42, not 100 (its share of the pool), and 1 -> 3 left it at 128.
    urls = [f"http://127.0.0.1:{9 + i}" for i in range(3)]  # never called: only their number counts
    start = 300 if replicas == 3 else 100
    pool = EndpointPool(
        "batch",
        LLMClient(batch_client_config(urls[:replicas], "m", _settings())),
        aimd=AimdSettings(initial_limit=start, max_limit=1000),
    )
    assert pool.limit == start
    pool.set_endpoints(urls[:to])
    assert pool.controller.limit == expected


def test_a_fixed_concurrency_below_one_is_refused() -> None:
    # 0 never let a call start, and the job waited for ever with its calls ready.
    with pytest.raises(ValueError, match="at least 1"):
        EndpointPool(
            "batch", LLMClient(batch_client_config(["http://127.0.0.1:9"], "m", _settings())), fixed_limit=0
        )


def test_a_controller_resized_back_regains_its_limit() -> None:
    controller = AimdController(AimdSettings(initial_limit=300, max_limit=1000), budget=384)
    controller.resize(128, 1 / 3)
    assert controller.limit == 100
    controller.resize(384, 3)
    assert controller.limit == 300


async def test_the_worker_starts_with_one_replica_of_two_down() -> None:
    # A fleet always has a replica down somewhere; waiting for every one kept the worker from starting
    # (a TimeoutError traceback after 30 s) while the live one could serve.
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_simulator(time_scale=0.01) as sim:
        config = batch_client_config([sim.url, dead], "m", _settings(), health={"interval_s": 0.2})
        async with LLMClient(config) as client:
            await asyncio.wait_for(wait_for_first_replica(client), 10)
            assert [e.healthy for e in client.endpoints] == [True, False]
    async with LLMClient(batch_client_config([dead], "m", _settings())) as client:
        with pytest.raises(NoHealthyEndpoint, match="no LLM replica answered /health within 1 s"):
            await wait_for_first_replica(client, timeout_s=1.0)
