"""The batch worker: runs jobs concurrently against one endpoint pool, the scheduler's async shell."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from batch.config import BatchSettings
from batch.errors import InputChanged, JobLeaseHeld, JobStateError
from batch.job_run import JobRun
from batch.manifest import TERMINAL_STATES, JobManifest
from batch.mapreduce import LLMCall
from batch.pool import EndpointPool
from batch.scheduler import JobDemand, pick_next, start_order
from batch.signals import ProductSignalWriter
from batch.storage import JobStore

log = logging.getLogger(__name__)


ProgressCallback = Callable[[Sequence[JobRun]], None]


class BatchWorker:
    """Runs jobs against one endpoint pool: the scheduler's async shell.

    Jobs run concurrently (up to ``max_running_jobs``) and share the pool: each free slot goes to the
    job ``scheduler.pick_next`` names. ``run`` returns the final manifests.
    """

    def __init__(
        self,
        settings: BatchSettings,
        *,
        store: JobStore,
        redis: aioredis.Redis,
        pool: EndpointPool,
        key_prefix: str,
        worker_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.redis = redis
        self.pool = pool
        self.key_prefix = key_prefix
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.signals = ProductSignalWriter(redis, key_prefix, settings.product_signal_ttl_s)
        self.active: dict[str, JobRun] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._interrupted = False
        self._job_finished = asyncio.Event()

    def interrupt(self) -> None:
        """Stop every job cleanly (SIGINT/SIGTERM): complete shards are written, the rest resumes."""
        self._interrupted = True
        for job in self.active.values():
            job.stop("interrupted")
        self._job_finished.set()

    async def run(
        self, job_ids: Sequence[str] | None = None, *, follow: bool = False, poll_s: float = 2.0
    ) -> list[JobManifest]:
        """Run the given jobs, or every runnable job (queued, or running with no live worker).

        With ``follow``, keep polling for newly submitted jobs until interrupted.
        """
        results: list[JobManifest] = []
        pending = list(job_ids) if job_ids is not None else None
        self.pool.start()
        dispatcher = asyncio.create_task(self._dispatch(), name="batch-dispatch")
        dispatcher.add_done_callback(self._dispatcher_ended)
        try:
            while not self._interrupted:
                await self._start_jobs(pending, results)
                if not self.active and not follow and not pending:
                    break
                # Look for startable jobs again when one finishes, or every poll_s (a wanted job may
                # be held by another worker's lease, or new jobs may have been submitted).
                self._job_finished.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_s):
                        await self._job_finished.wait()
            while self.active:
                self._job_finished.clear()
                await self._job_finished.wait()
        finally:
            dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatcher
            await self.pool.stop()
        return results

    def _dispatcher_ended(self, dispatcher: asyncio.Task[None]) -> None:
        """A dispatcher that fails dispatches nothing more: stop every job loudly, and start no other,
        instead of leaving their ready calls waiting for ever."""
        if dispatcher.cancelled() or (exc := dispatcher.exception()) is None:
            return
        log.error("the dispatcher failed", exc_info=exc)
        self._interrupted = True
        for job in self.active.values():
            job.stop(f"internal error: the dispatcher failed: {exc!r}")
        self._job_finished.set()

    async def _start_jobs(self, pending: list[str] | None, results: list[JobManifest]) -> None:
        room = self.settings.max_running_jobs - len(self.active)
        if room <= 0:
            return
        if pending is not None:
            candidates = [await self.store.read_manifest(j) for j in pending if j not in self.active]
        else:
            try:
                listed = await self.store.list_manifests()
            except Exception as exc:  # S3 down a moment: look again at the next poll, jobs run on
                log.warning("could not list the batch jobs (%r); looking again in a moment", exc)
                return
            candidates = [
                m for m in listed if m.state in ("queued", "running") and m.job_id not in self.active
            ]
        order = start_order(
            [JobDemand(m.job_id, m.spec.priority, m.spec.submitted_at, 0, 0) for m in candidates]
        )
        by_id = {m.job_id: m for m in candidates}
        started = 0
        for demand in order:  # all of them: a job another worker holds takes no room here
            if started >= room or self._interrupted:
                break
            manifest = by_id[demand.job_id]
            if manifest.state in TERMINAL_STATES and pending is not None:
                pending.remove(manifest.job_id)
                results.append(manifest)
                continue
            job = JobRun(
                manifest,
                store=self.store,
                redis=self.redis,
                signals=self.signals,
                pool=self.pool,
                settings=self.settings,
                key_prefix=self.key_prefix,
                worker_id=self.worker_id,
                wake=self._wake,
            )
            try:
                await job.claim()
            except JobLeaseHeld as exc:
                log.info("%s", exc)
                continue
            except JobStateError as exc:  # cancelled or finished since the manifest above was read
                log.info("%s", exc)
                if pending is not None:
                    pending.remove(manifest.job_id)
                    results.append(job.manifest)
                continue
            except (InputChanged, FileNotFoundError) as exc:
                manifest.state, manifest.message = "failed", str(exc)
                await self.store.write_manifest(manifest)
                if pending is not None:
                    pending.remove(manifest.job_id)
                results.append(manifest)
                continue
            except Exception as exc:
                if pending is not None:  # the jobs asked for by name: their error is the answer
                    raise
                # Following every job: S3 or Redis refused this claim (its lease was given back).
                # Started jobs run on, and this one is tried again at the next poll.
                log.warning(
                    "job %s could not start (%r); trying again at the next poll", manifest.job_id, exc
                )
                continue
            if pending is not None:
                pending.remove(manifest.job_id)
            if self._interrupted:  # SIGINT while it was being claimed: it stops as the others did
                job.stop("interrupted")
            started += 1
            self.active[job.job_id] = job
            task = asyncio.create_task(self._run_job(job, results), name=f"job-{job.job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_job(self, job: JobRun, results: list[JobManifest]) -> None:
        try:
            results.append(await job.run())
        finally:
            del self.active[job.job_id]
            self._wake.set()
            self._job_finished.set()

    async def _dispatch(self) -> None:
        pool = self.pool
        while True:
            jobs = list(self.active.values())
            limit = pool.limit
            job_id = None if pool.full else pick_next(limit, [j.demand() for j in jobs])
            if job_id is None:
                if pool.full:
                    pool.mark_limited()
                self._wake.clear()
                pool.changed.clear()
                waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(pool.changed.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                continue
            job = self.active[job_id]
            call = job.take()
            job.in_flight += 1
            pool.call_started()
            task = asyncio.create_task(self._call(job, call), name=f"call-{job.job_id}-{call.line}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # A done callback, not a ``finally`` in ``_call``: a task cancelled before it first runs
            # never enters its body, and its slot would stay counted for ever.
            task.add_done_callback(functools.partial(self._call_ended, job))

    async def _call(self, job: JobRun, call: LLMCall) -> None:
        try:
            await job.execute(call)
        except Exception as exc:  # a bug must stop the job loudly, not hang it
            log.exception("job %s: call failed unexpectedly", job.job_id)
            job.stop(f"internal error: {exc!r}")

    def _call_ended(self, job: JobRun, _: asyncio.Task[None]) -> None:
        job.in_flight -= 1
        self.pool.call_finished()
        self._wake.set()
