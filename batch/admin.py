"""Job administration: submit, cancel and resume batch jobs (manifests in S3, the lease in Redis)."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

import redis.asyncio as aioredis

from batch.errors import JobExists, JobNotFound, JobStateError, ManifestChanged
from batch.manifest import TERMINAL_STATES, JobManifest, JobSpec
from batch.storage import CONDITIONAL_CONFLICT_TRIES, JobStore, S3Uri
from sinks.keys import RedisKeys

log = logging.getLogger(__name__)


def new_job_id() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


async def submit_job(
    store: JobStore,
    input_uri: str,
    output_uri: str,
    *,
    priority: int = 0,
    shard_records: int = 100,
    job_id: str | None = None,
) -> JobManifest:
    """Register a job (state ``queued``); fails fast when the input does not exist, when ``job_id``
    names a job already registered (its manifest would be replaced, its history lost), or when the
    output already holds parts or is another registered job's (two jobs writing one output overwrite
    each other's parts; a job not started yet has none). Two submits at the same instant, to one
    output or under one id, are told apart by S3's conditional writes: each job claims its output
    (``JobStore.claim_output``) and writes its manifest only if none exists, so exactly one wins."""
    output = S3Uri.parse(output_uri.rstrip("/"))
    etag, size = await store.head(S3Uri.parse(input_uri))
    if job_id is not None:
        with contextlib.suppress(JobNotFound):
            await store.read_manifest(job_id)
            raise JobStateError(f"job {job_id} exists already; resume it, or submit under another id")
    if await store.part_shards(output):
        raise JobStateError(
            f"{output} holds output parts already (another job's): give this job an output of its own"
        )
    for other in await store.list_manifests():
        if other.spec.output_uri.rstrip("/") == str(output):
            raise JobStateError(
                f"{output} is the output of job {other.job_id} ({other.state}): resume that job, or give "
                "this one an output of its own"
            )
    spec = JobSpec(
        job_id=job_id or new_job_id(),
        input_uri=input_uri,
        output_uri=output_uri.rstrip("/"),
        priority=priority,
        shard_records=shard_records,
    )
    owner = await store.claim_output(output, spec.job_id)
    if owner is not None and owner != spec.job_id:
        raise JobStateError(
            f"{output} is the output of job {owner} (claimed at {store.output_claim(output)}; if no "
            "such job is registered, a submit of it died before its manifest: delete the claim): give "
            "this one an output of its own"
        )
    manifest = JobManifest(spec=spec, input_etag=etag, input_bytes=size)
    try:
        await store.write_manifest(manifest, new=True)
    except JobExists:
        # Another submit under this id won. Where its output is not this one, the claim made here names
        # a job that never writes this output: released, or the output stayed refused for ever.
        if owner is None and (await store.read_manifest(spec.job_id)).spec.output_uri != spec.output_uri:
            await store.release_output(output)
        raise JobStateError(
            f"job {spec.job_id} exists already; resume it, or submit under another id"
        ) from None
    return manifest


async def cancel_job(store: JobStore, redis: aioredis.Redis, prefix: str, job_id: str) -> JobManifest:
    """Ask the worker running the job to stop; a job no worker holds is marked cancelled at once.

    The marker is written before the lease is looked for, so a worker claiming the job meanwhile sees
    it (``JobRun.claim``). A worker that finished the job meanwhile has released its lease too: the
    manifest is read again after the marker and ``cancelled`` is written only over a state that is not
    final, and only over that very manifest (``If-Match`` on its ETag), so a job's ``succeeded`` (its
    ``errors_uri``, ``finished_at``, last shards) is never replaced by an earlier copy. Raises
    ``JobStateError`` for a job that is already finished, found so before or after the marker."""
    manifest = await store.read_manifest(job_id)
    if manifest.state in TERMINAL_STATES:
        raise JobStateError(f"job {job_id} is already {manifest.state}")
    await store.request_cancel(job_id)
    if await redis.get(RedisKeys(prefix).batch_lease(job_id)) is not None:
        return manifest  # its worker stops at its next checkpoint and writes ``cancelled`` itself
    for _ in range(CONDITIONAL_CONFLICT_TRIES):
        current, etag = await store.read_manifest_tagged(job_id)
        if current.state in TERMINAL_STATES:
            await store.clear_cancel(job_id)  # a finished job has nothing left to stop
            if current.state == "cancelled":  # a claiming worker saw the marker and wrote it
                return current
            raise JobStateError(f"job {job_id} is already {current.state}: it finished before the cancel")
        current.state = "cancelled"
        current.message = "cancelled before a worker picked it up"
        current.updated_at = time.time()
        try:
            await store.write_manifest(current, if_match=etag)
        except ManifestChanged:
            continue  # written since it was read: decide again on what is there now
        await store.clear_cancel(job_id)
        return current
    raise JobStateError(f"job {job_id}: its manifest kept changing during the cancel; try again")


async def prepare_resume(store: JobStore, job_id: str) -> JobManifest:
    """Make a killed, failed or cancelled job runnable again (state ``queued``)."""
    manifest = await store.read_manifest(job_id)
    if manifest.state == "succeeded":
        raise JobStateError(f"job {job_id} already succeeded; submit a new job to run it again")
    await store.clear_cancel(job_id)
    manifest.state = "queued"
    manifest.message = None
    manifest.updated_at = time.time()
    await store.write_manifest(manifest)
    return manifest
