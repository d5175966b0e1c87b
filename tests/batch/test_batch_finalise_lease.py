"""A job's end keeps its lease: the errors merge reads every errors part (minutes for a big job), and
the lease was not renewed meanwhile. With a lease shorter than the merge, a second worker following the
queue took the job, ran it again, and the first still wrote its manifest over the new holder's."""

from __future__ import annotations

import asyncio

import pytest

from batch.admin import submit_job
from batch.launch import batch_client_config, open_batch
from serving.simulator.testing import running_simulator
from tests.batch.test_batch_job import _settings, _upload
from tests.conftest import Isolated

pytestmark = pytest.mark.slow


async def test_a_second_worker_cannot_take_a_job_while_its_errors_are_merged(isolated: Isolated) -> None:
    settings = _settings(shard_records=10, checkpoint_interval_s=0.2, lease_ttl_s=1.0)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    lines = [b"{"] * 3000  # 300 shards, each with an errors part: the merge reads 300 objects
    async with running_simulator(time_scale=0.01) as sim:
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm) as first, open_batch(settings, sinks, llm) as second:
            await _upload(first.store, f"{base}/in.jsonl", lines)
            job = await submit_job(first.store, f"{base}/in.jsonl", f"{base}/out", shard_records=10)
            one, two = first.worker("worker-1"), second.worker("worker-2")
            running_one = asyncio.create_task(one.run([job.job_id]))
            while job.job_id not in one.active:
                await asyncio.sleep(0.01)
            following = asyncio.create_task(two.run(None, follow=True, poll_s=0.2))  # as `--follow` does
            claimed_by_two = False
            while not running_one.done():
                claimed_by_two = claimed_by_two or job.job_id in two.active
                await asyncio.sleep(0.01)
            (final,) = running_one.result()
            for _ in range(50):  # a few of worker-2's polls, after worker-1 released the job
                claimed_by_two = claimed_by_two or job.job_id in two.active
                await asyncio.sleep(0.01)
            two.interrupt()
            await asyncio.wait_for(following, 30)
            stored = await first.store.read_manifest(job.job_id)
    assert final.state == "succeeded" and final.records_failed == len(lines), final
    assert not claimed_by_two, "worker-2 took the job while worker-1 was merging its errors"
    assert stored.state == "succeeded" and stored.runs == 1, (stored.state, stored.runs)
