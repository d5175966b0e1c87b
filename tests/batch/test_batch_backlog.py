"""How far a batch job's reader runs ahead of S3: complete shards not yet written are bounded, so
memory and what a kill throws away are too (``JobRun.commit_backlog``)."""

from __future__ import annotations

import asyncio

from batch.admin import submit_job
from batch.launch import batch_client_config, open_batch
from serving.simulator.testing import running_simulator
from tests.batch.test_batch_job import _settings, _upload
from tests.conftest import Isolated


async def test_a_reader_of_broken_lines_waits_for_its_shards_to_be_written(isolated: Isolated) -> None:
    # Lines that do not parse (a truncated export) make no call, so they never count as open records;
    # only those held the reader back, and it queued every shard of the input as a commit in memory
    # (200 of 200 for 20,000 lines) before S3 had taken the first.
    settings = _settings(shard_records=100)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    line = b'{"custom_id": "prod-%07d", "body": {"title": "Witch costume", "text": "trunc'
    lines = [line % i for i in range(5000)]
    async with running_simulator(time_scale=0.01) as sim:
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm) as runtime:
            await _upload(runtime.store, f"{base}/in.jsonl", lines)
            job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
            worker = runtime.worker()
            running = asyncio.create_task(worker.run([job.job_id]))
            peak_commits = peak_ahead = 0
            while not running.done():
                run = worker.active.get(job.job_id)
                if run is not None:
                    peak_commits = max(peak_commits, len(run._commits))
                    peak_ahead = max(peak_ahead, run.lines_read - run.manifest.records_done)
                await asyncio.sleep(0.005)
            (final,) = running.result()
    assert final.state == "succeeded" and final.records_failed == len(lines), final
    backlog = (settings.commit_concurrency + 1) * settings.shard_records  # JobRun.commit_backlog
    most = settings.commit_concurrency + 1
    assert 0 < peak_commits <= most, f"{peak_commits} shards queued for S3 at once (at most {most})"
    assert peak_ahead <= backlog + 2 * settings.shard_records, (peak_ahead, backlog)
