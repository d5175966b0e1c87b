"""A batch job through a Redis restart of a few seconds, against a redis-server of its own, moto S3 and
a simulator replica: the shard writes that meet it wait it out, and the job succeeds. Four tries within
about 1.4 s failed the whole job, which ``shopper batch worker`` then left failed until a person resumed
it, though its lease (``lease_ttl_s``) outlasted the restart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from batch.admin import submit_job
from batch.launch import batch_client_config, open_batch
from batch.synthetic import synthetic_product_lines
from serving.simulator.testing import running_simulator
from tests.batch.test_batch_job import _settings, _upload
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis

pytestmark = pytest.mark.slow

DOWN_S = 3.0


async def test_a_job_rides_out_a_redis_restart_of_a_few_seconds(isolated: Isolated, tmp_path: Path) -> None:
    settings = _settings(shard_records=20, checkpoint_interval_s=0.5, lease_ttl_s=15.0)
    redis = OwnRedis(tmp_path)
    redis.start()
    try:
        sinks = isolated.sinks().model_copy(update={"redis_url": redis.url})
        base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
        lines = list(synthetic_product_lines(400, seed=3, long_share=0.0, bad_share=0.0))
        async with running_simulator(time_scale=0.05) as sim:
            llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
            async with open_batch(settings, sinks, llm, fixed_limit=8) as runtime:
                await _upload(runtime.store, f"{base}/in.jsonl", lines)
                job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out", shard_records=20)
                running = asyncio.create_task(runtime.worker().run([job.job_id]))
                while not (await runtime.store.read_manifest(job.job_id)).shards:
                    assert not running.done(), running
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(redis.kill)
                killed = time.monotonic()
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(redis.start)
                back_after = time.monotonic() - killed
                (final,) = await asyncio.wait_for(running, 120)
    finally:
        redis.stop()
    assert final.state == "succeeded", (final.state, final.message, f"Redis back after {back_after:.1f} s")
    assert len(final.shards) == len(lines) // 20 and final.records_failed == 0, final
