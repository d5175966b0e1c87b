"""Batch jobs against the real parts: simulator replicas over HTTP, Redis, moto S3.

Each test writes under its own S3 prefix and Redis key prefix (``isolated``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from batch.admin import cancel_job, prepare_resume, submit_job
from batch.config import BatchSettings
from batch.documents import PromptBudget, plan_document
from batch.errors import JobNotFound
from batch.launch import BatchRuntime, batch_client_config, open_batch
from batch.manifest import JobManifest
from batch.records import parse_line
from batch.storage import JobStore, S3Uri
from batch.synthetic import synthetic_product_lines
from devstack.stack import StackState
from serving.simulator.testing import running_simulator
from sinks.keys import RedisKeys
from tests.conftest import Isolated
from tests.helpers import served_total

REPO = Path(__file__).resolve().parents[2]


def _settings(**overrides: Any) -> BatchSettings:
    options: dict[str, Any] = {"shard_records": 50, "checkpoint_interval_s": 0.2, "lease_ttl_s": 2.0}
    options.update(overrides)
    return BatchSettings(**options)


def _llm(stack: StackState, settings: BatchSettings) -> Any:
    return batch_client_config(stack.llm_endpoints, stack.model, settings, health={"interval_s": 0.2})


async def _upload(store: JobStore, uri: str, lines: list[bytes]) -> None:
    await store.put(S3Uri.parse(uri), b"\n".join(lines) + b"\n", "application/x-ndjson")


async def _all_rows(
    store: JobStore, manifest: JobManifest
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every output row and error row in the job's parts (not the merged errors file)."""
    out = S3Uri.parse(manifest.spec.output_uri)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    paginator = store.client.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=out.bucket, Prefix=out.key + "/"):
        for entry in page.get("Contents", []):
            name = entry["Key"][len(out.key) + 1 :]
            if name.startswith("part-"):
                rows += await store.read_jsonl(S3Uri(out.bucket, entry["Key"]))
            elif name.startswith("errors/part-"):
                errors += await store.read_jsonl(S3Uri(out.bucket, entry["Key"]))
    return rows, errors


def _served(stack: StackState) -> int:
    """LLM requests the simulator replicas have taken (served or aborted): the work actually spent."""
    total = 0
    for url in stack.llm_endpoints:
        with urllib.request.urlopen(url + "/admin/stats", timeout=5) as response:
            engine = json.load(response)["engine"]
        total += engine["served"] + engine["aborted"]
    return total


async def _run(runtime: BatchRuntime, job_ids: list[str]) -> dict[str, JobManifest]:
    results = await runtime.worker().run(job_ids)
    return {m.job_id: m for m in results}


async def test_job_writes_every_line_once_with_splits_errors_and_signals(
    stack: StackState, isolated: Isolated, redis_client: Any
) -> None:
    budget = PromptBudget(context_tokens=1200, max_output_tokens=160, max_parts=8)
    settings = _settings(budget=budget)
    sinks = isolated.sinks()
    lines = list(
        synthetic_product_lines(300, seed=3, long_share=0.03, long_tokens=(1_500, 3_000), bad_share=0.03)
    )
    oversized = {"custom_id": "too-long", "body": {"title": "Encyclopedia", "text": "Volume one. " * 8_000}}
    lines += [orjson.dumps(oversized), b"", b"   "]
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        uri = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}/in.jsonl"
        await _upload(runtime.store, uri, lines)
        manifest = await submit_job(runtime.store, uri, f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}/out/")
        final = (await _run(runtime, [manifest.job_id]))[manifest.job_id]
        assert final.state == "succeeded", final.message
        assert final.total_records == len(lines) and final.records_done == len(lines)
        rows, errors = await _all_rows(runtime.store, final)
        merged = await runtime.store.read_jsonl(S3Uri.parse(final.errors_uri or ""))

    lines_seen = sorted(r["line"] for r in rows + errors)
    assert lines_seen == list(range(len(lines))), "every input line lands in exactly one row"
    assert final.records_ok == len(rows) and final.records_failed == len(errors)
    assert sorted(merged, key=lambda r: r["line"]) == sorted(errors, key=lambda r: r["line"])
    reasons = {e["error"]["reason"] for e in errors}
    assert {"unparseable", "invalid", "empty", "oversized"} <= reasons
    too_long = next(e for e in errors if e["custom_id"] == "too-long")
    assert "parts" in too_long["error"]["message"]
    split = [r for r in rows if r["response"]["body"]["parts"] > 1]
    assert split, "long documents went through map-reduce"
    assert final.requests > len(rows), "map-reduce costs more than one call per split product"

    for row in rows:
        key = RedisKeys(sinks.redis_key_prefix).product(row["response"]["body"]["product_id"])
        stored = await redis_client.hgetall(key)
        understanding = row["response"]["body"]["understanding"]
        assert json.loads(stored[b"segments"]) == understanding["segments"]
        assert stored[b"job_id"].decode() == final.job_id


@pytest.mark.slow
async def test_resume_after_kill_redoes_only_open_shards(
    stack: StackState, stack_dir: Path, isolated: Isolated
) -> None:
    settings = _settings()
    sinks = isolated.sinks()
    records = 1_500
    lines = list(synthetic_product_lines(records, seed=5, long_share=0.0, bad_share=0.0))
    job_id = f"kill-{isolated.tag}"
    uri = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}/in.jsonl"
    out = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}/out"
    concurrency = 24
    async with JobStore(sinks, settings.jobs_prefix) as store:
        await _upload(store, uri, lines)
        served_before = _served(stack)
        env = {
            **os.environ,
            "SINK_REDIS_KEY_PREFIX": sinks.redis_key_prefix,
            "BATCH_SHARD_RECORDS": str(settings.shard_records),
            "BATCH_CHECKPOINT_INTERVAL_S": str(settings.checkpoint_interval_s),
            "BATCH_LEASE_TTL_S": str(settings.lease_ttl_s),
        }
        argv = [
            sys.executable, "-m", "shopper", "batch", "submit", "--input", uri, "--output", out,
            "--job-id", job_id, "--fixed-concurrency", str(concurrency), "--state-dir", str(stack_dir),
        ]  # fmt: skip
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{job_id}.log"
        with log_path.open("wb") as sink:
            worker = await asyncio.create_subprocess_exec(
                *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=sink
            )
        try:
            deadline = time.monotonic() + 90
            committed = 0
            while committed < 10:  # at least 500 records committed before the kill
                assert worker.returncode is None, log_path.read_text()[-2000:]
                assert time.monotonic() < deadline, "the job did not get going"
                await asyncio.sleep(0.1)
                try:
                    committed = len((await store.read_manifest(job_id)).shards)
                except JobNotFound:
                    committed = 0
            worker.send_signal(signal.SIGKILL)
        finally:
            if worker.returncode is None:
                worker.kill()
            await worker.wait()
            log_path.unlink(missing_ok=True)
        killed = await store.read_manifest(job_id)
        assert killed.state == "running" and killed.total_records is None
        await prepare_resume(store, job_id)

    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        final = (await _run(runtime, [job_id]))[job_id]  # waits out the killed worker's lease
        rows, errors = await _all_rows(runtime.store, final)
    assert final.state == "succeeded" and final.runs == 2
    assert sorted(r["line"] for r in rows) == list(range(records)) and not errors
    spent = _served(stack) - served_before
    redone = spent - final.requests
    # In flight (24) plus completed records of shards still open at the kill (a few shards of 50).
    assert 0 <= redone <= concurrency + 4 * settings.shard_records, (spent, final.requests)


@pytest.mark.slow
async def test_priority_and_cancel_then_resume(stack: StackState, isolated: Isolated) -> None:
    settings = _settings()
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    async with open_batch(settings, sinks, _llm(stack, settings), fixed_limit=6) as runtime:
        store = runtime.store
        await _upload(
            store, f"{base}/low.jsonl", list(synthetic_product_lines(100, seed=1, long_share=0, bad_share=0))
        )
        await _upload(
            store, f"{base}/high.jsonl", list(synthetic_product_lines(50, seed=2, long_share=0, bad_share=0))
        )
        low = await submit_job(store, f"{base}/low.jsonl", f"{base}/low-out", priority=0)
        high = await submit_job(store, f"{base}/high.jsonl", f"{base}/high-out", priority=5)
        results = await _run(runtime, [low.job_id, high.job_id])
        assert {m.state for m in results.values()} == {"succeeded"}
        low_done, high_done = results[low.job_id].finished_at, results[high.job_id].finished_at
        assert low_done is not None and high_done is not None and high_done < low_done

        big = list(synthetic_product_lines(1_000, seed=4, long_share=0, bad_share=0))
        await _upload(store, f"{base}/big.jsonl", big)
        job = await submit_job(store, f"{base}/big.jsonl", f"{base}/cancel-out", priority=1)
        worker = runtime.worker()
        running = asyncio.create_task(worker.run([job.job_id]))
        while not (await store.read_manifest(job.job_id)).shards:
            await asyncio.sleep(0.05)
        await cancel_job(store, runtime.redis, sinks.redis_key_prefix, job.job_id)
        (cancelled,) = await running
        assert cancelled.state == "cancelled" and 1 <= len(cancelled.shards) < 20
        await prepare_resume(store, job.job_id)

    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        resumed = (await _run(runtime, [job.job_id]))[job.job_id]
        assert resumed.state == "succeeded" and resumed.runs == 2
        rows, _ = await _all_rows(runtime.store, resumed)
        assert sorted(r["line"] for r in rows) == list(range(1_000))


@pytest.mark.slow
async def test_interrupted_worker_leaves_the_job_queued_for_any_worker(
    stack: StackState, isolated: Isolated
) -> None:
    """SIGINT/SIGTERM in the CLI call ``interrupt``: complete shards are written, the job goes back to
    ``queued`` and the next worker (here one listing the queue, no ids given) finishes it."""
    settings = _settings()
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    llm = _llm(stack, settings)
    settings_for_queue = settings.model_copy(update={"jobs_prefix": f"jobs-{isolated.tag}"})
    async with open_batch(settings_for_queue, sinks, llm, fixed_limit=6) as runtime:
        await _upload(
            runtime.store, f"{base}/in.jsonl", list(synthetic_product_lines(600, seed=8, long_share=0))
        )
        job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
        worker = runtime.worker()
        running = asyncio.create_task(worker.run([job.job_id]))
        while not (await runtime.store.read_manifest(job.job_id)).shards:
            await asyncio.sleep(0.05)
        worker.interrupt()
        (interrupted,) = await running
        assert interrupted.state == "queued" and "interrupted" in (interrupted.message or "")
        assert 1 <= len(interrupted.shards) < 12
    async with open_batch(settings_for_queue, sinks, llm) as runtime:
        (final,) = await runtime.worker().run()
        assert final.job_id == job.job_id and final.state == "succeeded" and final.runs == 2
        rows, errors = await _all_rows(runtime.store, final)
        assert sorted(r["line"] for r in rows + errors) == list(range(600))


async def test_a_call_that_fails_while_the_job_stops_is_tried_by_the_resumed_job(isolated: Isolated) -> None:
    """Calls in flight when a worker is interrupted finish; one that fails then (here past its deadline,
    at a replica that slowed down) is not written off as ``llm_failed`` while tries are left: its
    line stays open, so its shard is not written, and the resumed job answers it. It was an error row
    that completed its shard, and a resume never tried it again."""
    settings = _settings(shard_records=20, call_deadline_s=1.5, call_attempts=2)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    lines = list(synthetic_product_lines(20, seed=12, long_share=0, bad_share=0))
    async with running_simulator(time_scale=0.02) as sim:
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm, fixed_limit=20) as runtime:
            await _upload(runtime.store, f"{base}/in.jsonl", lines)
            job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
            await _simulator_config(sim.url, slowdown=1000.0)  # every call now runs past its deadline
            worker = runtime.worker()
            running = asyncio.create_task(worker.run([job.job_id]))
            while job.job_id not in worker.active or worker.active[job.job_id].in_flight < 20:
                await asyncio.sleep(0.02)
            worker.interrupt()
            (interrupted,) = await running
    assert interrupted.state == "queued" and not interrupted.shards, interrupted
    async with running_simulator(time_scale=0.02) as sim:  # the slowed replica is replaced
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm) as runtime:
            resumed = (await _run(runtime, [job.job_id]))[job.job_id]
            rows, errors = await _all_rows(runtime.store, resumed)
    assert resumed.state == "succeeded" and resumed.runs == 2, resumed
    assert errors == [] and sorted(r["line"] for r in rows) == list(range(20))


async def _simulator_config(url: str, **faults: float) -> None:
    async with aiohttp.ClientSession() as http, http.post(url + "/admin/config", json=faults) as r:
        assert r.status == 200, await r.text()


async def test_a_record_written_off_sends_none_of_its_other_calls(isolated: Isolated) -> None:
    """A record of many parts whose first answer is unusable is written off at once; its other
    parts' calls, queued behind it, were still sent and paid for. Counted at the replica."""
    budget = PromptBudget(context_tokens=700, max_output_tokens=100, max_parts=16)
    settings = _settings(budget=budget)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    record = {"custom_id": "long", "body": {"title": "Lantern", "text": "Warm light for the porch. " * 400}}
    async with running_simulator(time_scale=0.01, bad_answer="not_understanding") as sim:
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm, fixed_limit=1) as runtime:
            await _upload(runtime.store, f"{base}/in.jsonl", [orjson.dumps(record)])
            job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
            final = (await _run(runtime, [job.job_id]))[job.job_id]
            _, errors = await _all_rows(runtime.store, final)
        bad_answers = await served_total(
            sim.url + "/metrics", "sim_request_errors_total", reason="bad_answer"
        )
    assert [e["error"]["reason"] for e in errors] == ["invalid_answer"]
    parts = len(plan_document(parse_line(0, orjson.dumps(record)), budget).parts)
    assert parts >= 8 and 1 <= bad_answers <= 2, (parts, bad_answers)  # one call, its retry elsewhere at most


async def test_every_try_of_a_failed_call_is_counted(isolated: Isolated) -> None:
    """``requests`` counts map parts, reduces and retries: a call tried ``call_attempts`` times and
    then written off counted once."""
    settings = _settings(call_attempts=3)
    sinks = isolated.sinks()
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    lines = list(synthetic_product_lines(1, seed=5, long_share=0, bad_share=0))
    async with running_simulator(time_scale=0.01, error_rate=1.0) as sim:
        llm = batch_client_config([sim.url], "qwen2.5-32b-sim", settings, health={"interval_s": 0.2})
        async with open_batch(settings, sinks, llm, fixed_limit=1) as runtime:
            await _upload(runtime.store, f"{base}/in.jsonl", lines)
            job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
            final = (await _run(runtime, [job.job_id]))[job.job_id]
    assert final.records_failed == 1 and final.requests == 3, final
