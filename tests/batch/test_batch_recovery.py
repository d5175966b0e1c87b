"""What a kill, a cancel, a lost lease or an outsized line leaves behind, against the real parts:
simulator replicas over HTTP, Redis (the stack's, or a redis-server of the test's own that the test
kills) and moto S3. Each test writes under its own S3 prefix and Redis key prefix (``isolated``).

The states a kill leaves are built directly (a part in S3 whose signals never reached Redis, a manifest
read just before a cancel, a lease another worker took over): the same objects the kill would leave,
without racing a SIGKILL against a millisecond window."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import orjson
import pytest
from botocore.exceptions import ClientError

from batch.admin import cancel_job, prepare_resume, submit_job
from batch.errors import JobStateError, ManifestChanged
from batch.job_run import JobRun
from batch.launch import BatchRuntime, open_batch
from batch.manifest import JobManifest, ShardCounts
from batch.multipart import MIN_PART_BYTES
from batch.records import error_row
from batch.signals import ProductSignalWriter
from batch.storage import JobStore, S3Uri, encode_jsonl, errors_part_key, part_key
from batch.synthetic import synthetic_product_lines
from devstack.stack import StackState
from sinks.keys import RedisKeys
from tests.batch.test_batch_job import _all_rows, _llm, _run, _settings, _upload
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis
from tests.sinks.test_sinks import s3_denying_a_prefix


def _job_run(runtime: BatchRuntime, manifest: JobManifest, worker_id: str, redis: Any = None) -> JobRun:
    """One job as a worker runs it (``BatchWorker`` builds the same), on ``redis`` if given."""
    redis = runtime.redis if redis is None else redis
    prefix = runtime.sinks.redis_key_prefix
    return JobRun(
        manifest,
        store=runtime.store,
        redis=redis,
        signals=ProductSignalWriter(redis, prefix, runtime.settings.product_signal_ttl_s),
        pool=runtime.pool,
        settings=runtime.settings,
        key_prefix=prefix,
        worker_id=worker_id,
        wake=asyncio.Event(),
    )


async def _submit_blank_lines(
    runtime: BatchRuntime, isolated: Isolated, shards: int, name: str = "blank"
) -> JobManifest:
    """A job whose lines are all blank: every line is an ``empty`` error row at once, with no LLM
    call, so its shards complete as soon as the reader has read them."""
    base = f"s3://{runtime.sinks.s3_bucket}/{isolated.s3_prefix}/{name}"
    await _upload(runtime.store, f"{base}.jsonl", [b""] * (shards * runtime.settings.shard_records))
    return await submit_job(
        runtime.store, f"{base}.jsonl", f"{base}-out", shard_records=runtime.settings.shard_records
    )


async def test_resume_writes_the_signals_of_shards_adopted_after_a_kill(
    stack: StackState, isolated: Isolated, redis_client: Any
) -> None:
    """A kill after a shard's part is written and before its product signals are: the part is
    adopted on resume, and its signals must reach Redis then (they never would otherwise)."""
    settings = _settings()
    sinks = isolated.sinks()
    records = 2 * settings.shard_records
    lines = list(synthetic_product_lines(records, seed=11, long_share=0.0, bad_share=0.0))
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        await _upload(runtime.store, f"{base}/in.jsonl", lines)
        job = await submit_job(
            runtime.store, f"{base}/in.jsonl", f"{base}/out", shard_records=settings.shard_records
        )
        first = (await _run(runtime, [job.job_id]))[job.job_id]
        assert first.state == "succeeded", first.message
        rows, _ = await _all_rows(runtime.store, first)
        assert len(rows) == records
        keys = [RedisKeys(sinks.redis_key_prefix).product(r["response"]["body"]["product_id"]) for r in rows]

        # What the kill leaves: every part in S3, no signal in Redis, no checkpoint since the start.
        await redis_client.delete(*keys)
        killed = first.model_copy(update={"state": "running", "shards": {}, "total_records": None})
        await runtime.store.write_manifest(killed)
        await prepare_resume(runtime.store, job.job_id)

        resumed = (await _run(runtime, [job.job_id]))[job.job_id]
    assert resumed.state == "succeeded" and resumed.runs == first.runs + 1
    assert resumed.requests == first.requests, "adopted shards are not redone"
    for row, key in zip(rows, keys, strict=True):
        stored = await redis_client.hgetall(key)
        assert stored, f"no product signal for line {row['line']} after the resume"
        assert json.loads(stored[b"segments"]) == row["response"]["body"]["understanding"]["segments"]


async def test_a_job_cancelled_after_the_worker_read_its_manifest_stays_cancelled(
    stack: StackState, isolated: Isolated
) -> None:
    """A worker lists a queued job, the job is cancelled, then the worker claims it: the claim reads
    the manifest again and refuses, instead of writing ``running`` over ``cancelled``."""
    settings = _settings()
    sinks = isolated.sinks()
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        job = await _submit_blank_lines(runtime, isolated, shards=1)
        read_before_the_cancel = await runtime.store.read_manifest(job.job_id)
        cancelled = await cancel_job(runtime.store, runtime.redis, sinks.redis_key_prefix, job.job_id)
        assert cancelled.state == "cancelled"
        late = _job_run(runtime, read_before_the_cancel, "late-worker")
        with pytest.raises(JobStateError):
            await late.claim()
        assert (await runtime.store.read_manifest(job.job_id)).state == "cancelled"
        lease = RedisKeys(sinks.redis_key_prefix).batch_lease(job.job_id)
        assert await runtime.redis.get(lease) is None, "the refused claim gives its lease back"

        # The other order: the cancel's marker is written, then the worker takes the lease before
        # the cancel looks for one (so the cancel leaves the manifest to the worker).
        second = await _submit_blank_lines(runtime, isolated, shards=1, name="second")
        await runtime.store.request_cancel(second.job_id)
        with pytest.raises(JobStateError):
            await _job_run(runtime, second, "worker-a").claim()
        assert (await runtime.store.read_manifest(second.job_id)).state == "cancelled"
        assert not await runtime.store.cancel_requested(second.job_id)


async def test_a_worker_that_lost_its_lease_writes_nothing_over_the_new_holder(
    stack: StackState, isolated: Isolated
) -> None:
    """Worker A's lease expires and worker B takes the job and writes its manifest. A must not commit
    shards nor write ``failed`` (or anything) over B's manifest."""
    settings = _settings()
    sinks = isolated.sinks()
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        job = await _submit_blank_lines(runtime, isolated, shards=2)
        a = _job_run(runtime, job, "worker-a")
        await a.claim()
        lease = RedisKeys(sinks.redis_key_prefix).batch_lease(job.job_id)
        await runtime.redis.set(lease, "worker-b", px=int(settings.lease_ttl_s * 1000))
        theirs = await runtime.store.read_manifest(job.job_id)
        theirs.runs += 1
        theirs.message = "worker-b's run"
        await runtime.store.write_manifest(theirs)

        final = await a.run()
        stored = await runtime.store.read_manifest(job.job_id)
        written = await runtime.store.part_shards(S3Uri.parse(job.spec.output_uri))
    assert "lost the lease" in (final.message or "")
    assert stored == theirs, "the new holder's manifest is left as it wrote it"
    assert written == [], "no part written after the lease was lost"


async def test_a_worker_that_cannot_renew_its_lease_stops_writing(
    stack: StackState, isolated: Isolated, tmp_path: Path
) -> None:
    """Redis goes away: the worker may go on only while its last renewal lasts; after that another
    worker may hold the job, so it commits no shard and leaves the manifest as it was."""
    settings = _settings()
    sinks = isolated.sinks()
    own = OwnRedis(tmp_path)
    own.start()
    try:
        async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
            job = await _submit_blank_lines(runtime, isolated, shards=2)
            gone = sinks.model_copy(update={"redis_url": own.url}).redis_client()
            try:
                worker = _job_run(runtime, job, "worker-a", redis=gone)
                await worker.claim()
                claimed = await runtime.store.read_manifest(job.job_id)
                own.kill()
                await asyncio.sleep(settings.lease_ttl_s)  # the renewal it got at the claim runs out
                final = await worker.run()
            finally:
                await gone.aclose()
            stored = await runtime.store.read_manifest(job.job_id)
            written = await runtime.store.part_shards(S3Uri.parse(job.spec.output_uri))
    finally:
        own.stop()
    assert "could not renew the lease" in (final.message or "")
    assert written == [], "no part written without the lease"
    assert stored == claimed, "the manifest stays as the claim wrote it: resumable once the lease expires"


async def test_a_line_over_the_cap_is_an_oversized_error_row(stack: StackState, isolated: Isolated) -> None:
    """A line longer than ``max_line_bytes`` is never read whole: it becomes one ``oversized`` error
    row and the lines around it are processed as usual."""
    sinks = isolated.sinks()
    lines = list(synthetic_product_lines(6, seed=12, long_share=0.0, bad_share=0.0))
    cap = 2 * max(len(line) for line in lines)
    text = "Volume one. " * (cap // len("Volume one. ") + 1)
    huge = orjson.dumps({"custom_id": "too-long-a-line", "body": {"title": "Encyclopedia", "text": text}})
    assert len(huge) > cap
    at = len(lines) // 2
    lines.insert(at, huge)
    settings = _settings(max_line_bytes=cap)
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        await _upload(runtime.store, f"{base}/in.jsonl", lines)
        job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
        final = (await _run(runtime, [job.job_id]))[job.job_id]
        rows, errors = await _all_rows(runtime.store, final)
    assert final.state == "succeeded", final.message
    assert sorted(r["line"] for r in rows + errors) == list(range(len(lines)))
    (error,) = errors
    assert error["line"] == at and error["error"]["reason"] == "oversized"
    assert str(len(huge)) in error["error"]["message"] and "max_line_bytes" in error["error"]["message"]


async def test_a_call_that_ends_without_an_outcome_stops_the_job_instead_of_hanging(
    stack: StackState, isolated: Isolated
) -> None:
    """A call cancelled from outside the job (a cancellation leaked by a library, say) leaves its
    record with no call ready or in flight. The job stops with an internal error naming its lines,
    and resumes later from its shards, instead of waiting for ever."""
    settings = _settings()
    sinks = isolated.sinks()
    lines = list(synthetic_product_lines(4, seed=13, long_share=0.0, bad_share=0.0))
    base = f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}"
    async with open_batch(settings, sinks, _llm(stack, settings)) as runtime:
        await _upload(runtime.store, f"{base}/in.jsonl", lines)
        job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
        running = asyncio.create_task(_run(runtime, [job.job_id]))
        calls: list[asyncio.Task[Any]] = []
        async with asyncio.timeout(30):
            while not calls:
                await asyncio.sleep(0.005)
                calls = [t for t in asyncio.all_tasks() if t.get_name().startswith(f"call-{job.job_id}-")]
        for call in calls:
            call.cancel()
        final = (await asyncio.wait_for(running, 60))[job.job_id]
    assert final.state == "failed"
    assert final.message is not None and "no call ready or in flight" in final.message, final.message


async def test_an_output_another_job_wrote_is_refused_and_never_adopted(
    stack: StackState, isolated: Isolated
) -> None:
    """A job claiming its work took every part under its output its manifest did not list as its own
    finished shard: submitted with another job's output, it took that job's answers as its own and
    skipped its own input's lines. Now such a submit is refused, as is a job id in use, and a part
    another job wrote (two jobs racing for one output) is never adopted."""
    settings = _settings()
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        first = await _submit_blank_lines(runtime, isolated, shards=1, name="first")
        assert (await _run(runtime, [first.job_id]))[first.job_id].state == "succeeded"
        other = await _submit_blank_lines(runtime, isolated, shards=1, name="other")
        with pytest.raises(JobStateError, match="output parts already"):
            await submit_job(runtime.store, other.spec.input_uri, first.spec.output_uri)
        with pytest.raises(JobStateError, match="exists already"):
            await submit_job(
                runtime.store, other.spec.input_uri, f"{other.spec.output_uri}-2", job_id=first.job_id
            )
        assert (await runtime.store.read_manifest(first.job_id)).state == "succeeded", "its manifest is kept"

        output = S3Uri.parse(other.spec.output_uri)
        await runtime.store.write_shard(output, 0, [{"line": 0}], [], ShardCounts(ok=1), first.job_id)
        assert await runtime.store.written_shards(output, other.job_id) == {}
        final = (await _run(runtime, [other.job_id]))[other.job_id]
    assert final.state == "succeeded", final.message
    assert final.shards[0].errors == settings.shard_records, "its own blank lines, not the other job's part"


async def test_a_worker_listing_the_queue_skips_a_manifest_it_cannot_read(
    stack: StackState, isolated: Isolated
) -> None:
    """One manifest that does not validate (another version's, a hand edit) made every listing fail,
    and the worker following the queue died with it, its running jobs stopped unfinished. Now that one
    job is skipped and the others run."""
    settings = _settings().model_copy(update={"jobs_prefix": f"jobs-{isolated.tag}"})
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        job = await _submit_blank_lines(runtime, isolated, shards=1)
        broken = runtime.store.job_dir("broken-job").child("manifest.json")
        await runtime.store.put(broken, b'{"spec": "not a manifest"}', "application/json")
        (final,) = await runtime.worker().run()
    assert final.job_id == job.job_id and final.state == "succeeded", final.message


async def test_a_shard_redone_without_errors_removes_the_errors_part_of_its_first_try(
    stack: StackState, isolated: Isolated
) -> None:
    """A kill between a shard's errors part and its output part, then a resume that answers the line:
    the old errors part listed as failed a line the output part answers. Against the stack's S3."""
    settings = _settings()
    sinks = isolated.sinks()
    output = S3Uri.parse(f"s3://{sinks.s3_bucket}/{isolated.s3_prefix}/redone-out")
    async with JobStore(sinks, settings.jobs_prefix) as store:
        failed = [{"line": 5, "error": {"reason": "llm_failed"}}]
        await store.write_shard(output, 0, [], failed, ShardCounts(errors=1), "job-1")
        assert await store.exists(errors_part_key(output, 0))
        await store.write_shard(output, 0, [{"line": 5}], [], ShardCounts(ok=1), "job-1")
        assert not await store.exists(errors_part_key(output, 0))
        assert await store.read_jsonl(part_key(output, 0)) == [{"line": 5}]


async def test_the_output_of_a_job_not_started_yet_is_refused(stack: StackState, isolated: Isolated) -> None:
    """Only parts were looked for: a second job submitted to the output of a job still queued (no
    parts yet) was accepted, and the two overwrote each other's parts and summary, each reporting
    success."""
    settings = _settings()
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        queued = await _submit_blank_lines(runtime, isolated, shards=1, name="queued")
        with pytest.raises(JobStateError, match=f"output of job {queued.job_id} \\(queued\\)"):
            await submit_job(runtime.store, queued.spec.input_uri, queued.spec.output_uri + "/")


async def test_a_job_another_worker_holds_takes_no_room_here(stack: StackState, isolated: Isolated) -> None:
    """With room for one job, a worker listing the queue tried the first job in start order, found it
    held by another worker, and started nothing: the held job had taken the room. A plain ``shopper
    batch worker`` then exited with a job still queued."""
    settings = _settings(max_running_jobs=1).model_copy(update={"jobs_prefix": f"jobs-{isolated.tag}"})
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        held = await _submit_blank_lines(runtime, isolated, shards=1, name="held")
        queued = await _submit_blank_lines(runtime, isolated, shards=1, name="queued")
        other = _job_run(runtime, held, "another-worker")
        assert await other.lease.acquire()  # another live worker runs it
        try:
            results = await runtime.worker().run()
        finally:
            await other.lease.release()
    assert [(m.job_id, m.state) for m in results] == [(queued.job_id, "succeeded")]


async def test_an_interrupt_while_a_job_is_claimed_stops_that_job_too(
    stack: StackState, isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT stopped the jobs already running; one whose claim was still awaiting S3 joined them
    afterwards and ran to its end, and the worker with it. Here the interrupt comes as the claim's
    last await returns."""
    settings = _settings()
    base = f"s3://{isolated.sinks().s3_bucket}/{isolated.s3_prefix}"
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings), fixed_limit=6) as runtime:
        lines = list(synthetic_product_lines(600, seed=8, long_share=0))
        await _upload(runtime.store, f"{base}/in.jsonl", lines)
        job = await submit_job(runtime.store, f"{base}/in.jsonl", f"{base}/out")
        worker = runtime.worker()
        claim = JobRun.claim

        async def claim_then_interrupted(self: JobRun) -> None:
            await claim(self)
            worker.interrupt()

        monkeypatch.setattr(JobRun, "claim", claim_then_interrupted)
        (result,) = await worker.run([job.job_id])
    assert result.state == "queued" and "interrupted" in (result.message or ""), result
    assert result.records_done < len(lines)


async def test_a_manifest_write_that_failed_is_made_at_the_next_checkpoint(
    stack: StackState, isolated: Isolated
) -> None:
    """A checkpoint whose manifest PUT S3 refuses leaves the shard it would have recorded to the next
    checkpoint, not to the next shard: before, the job marked itself clean before the write, so a
    refused write was never made again until another shard completed (and the last shard's never)."""
    settings = _settings()
    sinks = isolated.sinks()
    assert sinks.s3_endpoint_url is not None
    async with s3_denying_a_prefix(sinks.s3_endpoint_url, "/manifest.json") as (url, deny):
        deny["deny"] = False
        proxied = sinks.model_copy(update={"s3_endpoint_url": url})
        async with open_batch(settings, proxied, _llm(stack, settings)) as runtime:
            job = await _submit_blank_lines(runtime, isolated, shards=2)
            run = _job_run(runtime, job, "worker-a")
            await run.claim()
            counts = ShardCounts(errors=settings.shard_records)
            run.manifest.shards[0] = counts  # what committing shard 0 records, as _commit does
            run._dirty = True
            deny["deny"] = True
            with pytest.raises(Exception, match="AccessDenied"):
                await run.checkpoint()
            assert (await runtime.store.read_manifest(job.job_id)).shards == {}
            deny["deny"] = False
            await run.checkpoint()
            stored = await runtime.store.read_manifest(job.job_id)
            await run.lease.release()
    assert stored.shards == {0: counts}


async def test_a_resume_after_the_input_was_replaced_fails_instead_of_mixing_two_inputs(
    stack: StackState, isolated: Isolated
) -> None:
    """The manifest keeps the input's ETag from the first run: a resume over an input uploaded again
    with other lines fails the job (its committed shards were made from the old lines), while a resume
    over the same input runs."""
    settings = _settings()
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        job = await _submit_blank_lines(runtime, isolated, shards=1)
        first = (await _run(runtime, [job.job_id]))[job.job_id]
        assert first.state == "succeeded", first.message
        assert first.input_etag is not None

        async def killed_and_resumed() -> JobManifest:
            # What a kill leaves (no checkpoint since the start), then `shopper batch resume`.
            killed = first.model_copy(update={"state": "running", "shards": {}, "total_records": None})
            await runtime.store.write_manifest(killed)
            await prepare_resume(runtime.store, job.job_id)
            return (await _run(runtime, [job.job_id]))[job.job_id]

        same = await killed_and_resumed()
        assert same.state == "succeeded", same.message

        lines = [b""] * (2 * settings.shard_records)  # another input at the same URI: another ETag
        await _upload(runtime.store, job.spec.input_uri, lines)
        changed = await killed_and_resumed()
        assert (await runtime.store.read_manifest(job.job_id)).state == "failed"
    assert changed.state == "failed"
    assert changed.message is not None and "changed since" in changed.message


async def _two_submits_past_their_checks(
    store: JobStore, monkeypatch: pytest.MonkeyPatch, *submits: Awaitable[JobManifest]
) -> list[object]:
    """Run two submits so that both have listed the registry before either writes anything (the race
    of two submits at one instant, made certain rather than left to timing): the first to list waits
    until the second has listed too, and the second goes on only once the first has ended."""
    real, listed, both_listed, first_ended = store.list_manifests, [0], asyncio.Event(), asyncio.Event()

    async def list_then_wait() -> list[JobManifest]:
        manifests = await real()
        listed[0] += 1
        if listed[0] == 1:
            await both_listed.wait()
        else:
            both_listed.set()
            await first_ended.wait()
        return manifests

    async def ending(submit: Awaitable[JobManifest]) -> JobManifest:
        try:
            return await submit
        finally:
            first_ended.set()

    monkeypatch.setattr(store, "list_manifests", list_then_wait)
    try:
        return await asyncio.gather(*(ending(submit) for submit in submits), return_exceptions=True)
    finally:
        monkeypatch.setattr(store, "list_manifests", real)


async def test_two_submits_to_one_output_at_the_same_instant_register_one_job(
    stack: StackState, isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry was a listing of manifests: two submits at one instant both listed it before
    either wrote, both were registered, and their workers overwrote each other's parts. The output is
    claimed by a conditional write now, so one wins and the other is refused; the same for two submits
    under one job id, whose loser's output is free again."""
    settings = _settings()
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        store = runtime.store
        first = await _submit_blank_lines(runtime, isolated, shards=1, name="first")
        input_uri, output = first.spec.input_uri, f"{first.spec.output_uri}-both"
        outcomes = await _two_submits_past_their_checks(
            store, monkeypatch, submit_job(store, input_uri, output), submit_job(store, input_uri, output)
        )
        registered = [o for o in outcomes if isinstance(o, JobManifest)]
        refused = [o for o in outcomes if isinstance(o, JobStateError)]
        assert len(registered) == 1 and len(refused) == 1, outcomes
        assert f"output of job {registered[0].job_id}" in str(refused[0])
        one_id = f"one-id-{isolated.tag}"
        same_id = await _two_submits_past_their_checks(
            store,
            monkeypatch,
            submit_job(store, input_uri, f"{output}-a", job_id=one_id),
            submit_job(store, input_uri, f"{output}-b", job_id=one_id),
        )
        won = [o for o in same_id if isinstance(o, JobManifest)]
        assert len(won) == 1 and any("exists already" in str(o) for o in same_id), same_id
        # The loser's output is free again: its claim named a job that writes elsewhere, and is released.
        lost = ({f"{output}-a", f"{output}-b"} - {won[0].spec.output_uri}).pop()
        assert isinstance(await submit_job(store, input_uri, lost), JobManifest)
        listed = [m.spec.output_uri for m in await store.list_manifests()]
        assert listed.count(output) == 1


async def test_the_errors_merge_streams_in_parts_and_leaves_no_upload_behind_when_it_fails(
    stack: StackState, isolated: Isolated
) -> None:
    """The merge of the error rows read every errors part into memory, joined them (a second copy) and
    sent one PUT: a catalogue of mostly broken lines ran the worker out of memory, or past S3's 5 GB
    PUT, after all its LLM work, and every resume did the same again. Now the parts are streamed into a
    multipart upload: the merged object is their concatenation, the merge holds about two parts however
    large it grows, and a merge that fails half way aborts its upload (no parts left stored)."""
    settings = _settings()
    output = S3Uri.parse(f"s3://{isolated.sinks().s3_bucket}/{isolated.s3_prefix}/many-errors-out")
    part_bytes = MIN_PART_BYTES
    message = "the model's answer is not what the schema allows: " + "x" * 450
    bodies: list[bytes] = []
    async with JobStore(isolated.sinks(), settings.jobs_prefix) as store:
        line = 0
        while sum(map(len, bodies)) < 6 * part_bytes:  # each shard ~0.75 MiB, 40 or so of them
            rows = [
                error_row("job-1", line + i, "invalid_answer", message, f"p-{line + i}") for i in range(1200)
            ]
            line += len(rows)
            bodies.append(encode_jsonl(rows))
            await store.put(errors_part_key(output, len(bodies) - 1), bodies[-1], "application/x-ndjson")
        total = sum(map(len, bodies))
        shards = list(range(len(bodies)))

        tracemalloc.start()
        try:
            merged_uri = await store.merge_errors(output, shards, part_bytes=part_bytes)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        held = f"the merge held {peak} bytes at its peak for {total} bytes of errors"
        assert peak < 3 * part_bytes <= total / 2, held  # about two parts: the one filling, the one sent
        merged = await store.read(merged_uri)
        assert merged == b"".join(bodies), "the merged object is every errors part, in shard order"
        etag, _ = await store.head(merged_uri)
        assert "-" in etag, f"written as a multipart upload (ETag {etag})"

        # A merge failing after some parts are uploaded: the last shard's errors part is missing.
        with pytest.raises(ClientError, match="NoSuchKey"):
            await store.merge_errors(output, [*shards, len(bodies)], part_bytes=part_bytes)
        uploads = await store.client.list_multipart_uploads(Bucket=output.bucket, Prefix=output.key + "/")
        assert uploads.get("Uploads", []) == [], "the failed merge's upload is aborted"
        assert await store.read(merged_uri) == merged, "the earlier merged object is left whole"


class _MarkerHeldBack(JobStore):
    """A JobStore (its own S3 client, as the ``cancel`` command has) whose cancel marker is written
    only once ``go`` is set; ``waiting`` says the cancel has read the manifest and reached the marker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def request_cancel(self, job_id: str) -> None:
        self.waiting.set()
        await self.go.wait()
        await super().request_cancel(job_id)


async def test_a_cancel_racing_a_job_that_finishes_leaves_its_succeeded_manifest(
    stack: StackState, isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel read the manifest of a running job, wrote its marker, found no lease (the worker had
    just released it after writing ``succeeded``) and wrote its earlier copy as ``cancelled``: the
    job's ``errors_uri``, ``finished_at`` and last shards were lost. Here the cancel reads the manifest
    once the worker has claimed the job and writes its marker only after the worker has finished."""
    settings = _settings()
    sinks = isolated.sinks()
    async with (
        open_batch(settings, sinks, _llm(stack, settings)) as runtime,
        _MarkerHeldBack(sinks, settings.jobs_prefix) as cancel_store,
    ):
        job = await _submit_blank_lines(runtime, isolated, shards=2)
        claim, cancelling = JobRun.claim, []

        async def claim_then_a_cancel_reads(self: JobRun) -> None:
            await claim(self)
            cancel = cancel_job(cancel_store, runtime.redis, sinks.redis_key_prefix, job.job_id)
            cancelling.append(asyncio.create_task(cancel))
            await cancel_store.waiting.wait()  # it has read the manifest: 'running'

        monkeypatch.setattr(JobRun, "claim", claim_then_a_cancel_reads)
        final = (await _run(runtime, [job.job_id]))[job.job_id]
        assert final.state == "succeeded", final.message
        cancel_store.go.set()
        (outcome,) = await asyncio.gather(*cancelling, return_exceptions=True)
        stored = await runtime.store.read_manifest(job.job_id)
        marker_left = await runtime.store.cancel_requested(job.job_id)
    assert stored.state == "succeeded", f"the cancel wrote {stored.state!r} over the finished job"
    assert stored.errors_uri == final.errors_uri and stored.errors_uri is not None
    assert stored.finished_at == final.finished_at and stored.shards == final.shards
    assert isinstance(outcome, JobStateError) and "already succeeded" in str(outcome), outcome
    assert not marker_left, "a finished job keeps no cancel marker"


async def test_a_manifest_written_since_it_was_read_refuses_a_conditional_write(
    stack: StackState, isolated: Isolated
) -> None:
    """What the cancel's last write relies on: ``If-Match`` on the ETag it read is refused once another
    writer (a worker finishing the job) has written the manifest since, and the newer one stays."""
    settings = _settings()
    async with open_batch(settings, isolated.sinks(), _llm(stack, settings)) as runtime:
        job = await _submit_blank_lines(runtime, isolated, shards=1)
        read, etag = await runtime.store.read_manifest_tagged(job.job_id)
        newer = read.model_copy(update={"state": "succeeded", "finished_at": 1.0})
        await runtime.store.write_manifest(newer)
        stale = read.model_copy(update={"state": "cancelled"})
        with pytest.raises(ManifestChanged):
            await runtime.store.write_manifest(stale, if_match=etag)
        assert await runtime.store.read_manifest(job.job_id) == newer
        _, current = await runtime.store.read_manifest_tagged(job.job_id)
        await runtime.store.write_manifest(stale, if_match=current)
        assert (await runtime.store.read_manifest(job.job_id)).state == "cancelled"
