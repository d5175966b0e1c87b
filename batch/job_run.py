"""One batch job inside a worker: read input lines, plan prompts, dispatch LLM calls by priority under
the pool's adaptive limit, commit complete shards to S3 and Redis, checkpoint the manifest.

Guarantees:
- every input line ends in exactly one row: an output row in its shard's part, or an error row with
  a reason in its shard's errors part (and in ``errors.jsonl`` when the job succeeds);
- a shard's part is written once it is complete, under a key fixed by the shard number, so a redone
  shard overwrites rather than duplicates; product signals in Redis are overwrites too;
- after a kill, a resumed job redoes only shards that were not yet written (records in flight plus
  at most one shard per open shard), adopting parts written after the last manifest checkpoint, and
  writes an adopted shard's product signals again (the kill may have come between its part and its
  Redis write; the write is an overwrite, so doing it twice is harmless);
- one worker at a time runs a job (the Redis lease): the manifest is read again once the lease is
  held, and a worker writes a part, signals or the manifest only while it still holds the lease
  (``JobLease.still_held``). A worker that loses it stops and leaves the manifest to the new holder.

Everything here is I/O glue around the pure parts: ``documents``/``mapreduce`` (what to ask),
``scheduler`` (whose call goes next), ``aimd`` (how many at once), ``manifest`` (what is done).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from batch.config import BatchSettings
from batch.coordination import JobLease, publish_progress
from batch.documents import plan_document
from batch.errors import InputChanged, JobLeaseHeld, JobStateError
from batch.lines import OversizedLine
from batch.manifest import TERMINAL_STATES, JobManifest, ShardBook, ShardCommit
from batch.mapreduce import LLMCall, RecordWork
from batch.pool import EndpointPool
from batch.records import BadRecord, ErrorReason, error_row, output_row, parse_line
from batch.scheduler import JobDemand
from batch.signals import ProductSignalWriter
from batch.storage import JobStore, S3Uri, part_key
from batch.understanding import (
    ProductUnderstanding,
    parse_product_understanding,
    parse_unguided_product_understanding,
    product_response_format,
)
from llm_client.errors import InvalidAnswer, LLMError
from llm_client.models import Completion
from pipeline.cancellation import cancel_and_wait
from pipeline.sink_retry import SinkRetry, with_sink_retry
from sinks.keys import RedisKeys

log = logging.getLogger(__name__)


class JobRun:
    """One job inside a worker: its reader, its ready calls, its open records and shards."""

    def __init__(
        self,
        manifest: JobManifest,
        *,
        store: JobStore,
        redis: aioredis.Redis,
        signals: ProductSignalWriter,
        pool: EndpointPool,
        settings: BatchSettings,
        key_prefix: str,
        worker_id: str,
        wake: asyncio.Event,
    ) -> None:
        self.manifest = manifest
        self.spec = manifest.spec
        self.job_id = manifest.job_id
        self.store = store
        self.redis = redis
        self.signals = signals
        self.pool = pool
        self.settings = settings
        self.key_prefix = key_prefix
        self.output = S3Uri.parse(self.spec.output_uri)
        self.lease = JobLease(redis, key_prefix, self.job_id, worker_id, settings.lease_ttl_s)
        self.book = ShardBook(self.spec.shard_records)
        self.ready: deque[LLMCall] = deque()
        self.works: dict[int, RecordWork] = {}
        self.in_flight = 0
        self.lines_read = 0
        self.bytes_read = 0
        self.reader_done = False
        self.stopping: str | None = None
        """Why the job stops early: 'cancelled', 'interrupted', or a failure message."""
        self.requests_here = 0
        self._wake = wake
        self._room = asyncio.Event()
        self._commit_gate = asyncio.Semaphore(settings.commit_concurrency)
        self._commits: set[asyncio.Task[None]] = set()
        self._committing = 0
        """Records in shards being written (between the book and the manifest)."""
        self._dirty = False
        self._closing = False
        self._rate_samples: deque[tuple[float, int]] = deque(maxlen=32)
        self._response_format = product_response_format() if settings.guided_json else None
        self._validate = (
            parse_product_understanding if settings.guided_json else parse_unguided_product_understanding
        )

    # ---- scheduling view ---------------------------------------------------------------------------
    def demand(self) -> JobDemand:
        return JobDemand(
            self.job_id,
            self.spec.priority,
            self.spec.submitted_at,
            self.in_flight,
            0 if self.stopping else len(self.ready),
        )

    @property
    def lookahead(self) -> int:
        """Open records allowed: enough to keep the pool's limit busy, few enough to bound memory
        and the work a kill throws away."""
        return max(2 * self.pool.limit, 64)

    @property
    def commit_backlog(self) -> int:
        """Records of complete shards the reader may run ahead of S3 by: the shards being written
        (``commit_concurrency``) and one more."""
        return (self.settings.commit_concurrency + 1) * self.spec.shard_records

    def _full(self) -> bool:
        """Whether the reader waits: open records at ``lookahead``, or complete shards not yet written
        past ``commit_backlog``. Only open records held it back before, and a shard of bad lines (no
        call, so never open) or answers coming faster than S3 took them queued every shard in memory:
        all 1,000 shards of a 100,000-line input before the first was written, and a kill threw away
        every answer they held."""
        return len(self.works) >= self.lookahead or self._committing >= self.commit_backlog

    @property
    def finished(self) -> bool:
        idle = self.in_flight == 0 and not self._commits
        if self.stopping:
            return idle
        return self.reader_done and not self.works and not self.ready and idle

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def claim(self) -> None:
        """Take the lease, read the manifest again (the caller's copy was read before the lease, so a
        cancel or another worker's finish may have come since) and check the input; adopt parts
        written after the last checkpoint. Raises ``JobStateError`` for a job that is no longer
        runnable; ``self.manifest`` is then the stored one."""
        if not await self.lease.acquire():
            raise JobLeaseHeld(
                f"job {self.job_id} is held by worker {await self.lease.holder()!r}; it expires "
                f"{self.settings.lease_ttl_s:.0f} s after that worker stops refreshing it"
            )
        try:
            await self._check_and_adopt()
        except BaseException:
            await self.lease.release()
            raise

    async def _check_and_adopt(self) -> None:
        # The cancel marker first, then the manifest: ``admin.cancel_job`` writes the marker before it
        # looks for a lease and clears it only after writing ``cancelled``, so in this order one of
        # the two is always seen.
        cancel_requested = await self.store.cancel_requested(self.job_id)
        self.manifest = m = await self.store.read_manifest(self.job_id)
        if m.state in TERMINAL_STATES:
            raise JobStateError(f"job {self.job_id} is {m.state}; resume it first")
        if cancel_requested:
            m.state, m.message = "cancelled", "cancelled before a worker picked it up"
            m.updated_at = time.time()
            await self.store.write_manifest(m)
            await self.store.clear_cancel(self.job_id)
            raise JobStateError(f"job {self.job_id} is cancelled; resume it first")
        etag, size = await self.store.head(S3Uri.parse(self.spec.input_uri))
        if m.input_etag is not None and etag != m.input_etag:
            raise InputChanged(
                f"{self.spec.input_uri} changed since job {self.job_id} first ran (ETag {m.input_etag} -> "
                f"{etag}); submit a new job for the new input"
            )
        m.input_etag, m.input_bytes = etag, size
        adopted = await self.store.written_shards(self.output, self.job_id, known=set(m.shards))
        for shard in sorted(adopted):
            # The part is written before the signals: a kill between the two left Redis without them.
            await self.signals.write(self.job_id, await self.store.read_jsonl(part_key(self.output, shard)))
        m.shards.update(adopted)
        if adopted:
            log.info(
                "job %s: adopted %d shard(s) written after the last checkpoint", self.job_id, len(adopted)
            )
        m.state, m.runs, m.message = "running", m.runs + 1, None
        m.updated_at = time.time()
        await self.store.write_manifest(m)
        self.book = ShardBook(self.spec.shard_records, committed=set(m.shards))

    async def run(self) -> JobManifest:
        """Read, wait until every shard is committed (or the job stops), finalise."""
        reader = asyncio.create_task(self._read(), name=f"reader-{self.job_id}")
        checkpoints = asyncio.create_task(self._checkpoints(), name=f"checkpoint-{self.job_id}")
        try:
            while not self.finished:
                if reader.done() and not self.stopping and (exc := reader.exception()) is not None:
                    self.stop(f"reading the input failed: {exc!r}")
                elif (stalled := self.stalled()) is not None:
                    log.error("job %s: %s", self.job_id, stalled)
                    self.stop(stalled)
                await asyncio.sleep(0.05)
        finally:
            self._closing = True  # ends the checkpoint loop even if a library swallows its cancel
            reader.cancel()
            checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            with contextlib.suppress(asyncio.CancelledError):
                await checkpoints
        return await self._finalise()

    def stalled(self) -> str | None:
        """Why the job can never finish, or None. Every open record has a call ready or in flight
        (its calls are queued when it is read, a follow-up is queued before its answer's call ends):
        open records with neither mean a call ended without an outcome. Without this check such a job
        waits for ever; with it, the job stops with a reason and resumes from its shards."""
        if self.stopping or not self.works or self.ready or self.in_flight:
            return None
        lines = sorted(self.works)
        shown = ", ".join(map(str, lines[:5])) + (" ..." if len(lines) > 5 else "")
        return f"internal error: {len(lines)} record(s) (lines {shown}) have no call ready or in flight"

    def stop(self, why: str) -> None:
        """Stop dispatching; in-flight calls finish and complete shards are still written."""
        if self.stopping is None:
            self.stopping = why
            self.ready.clear()
            self._room.set()
            self._wake.set()

    async def _finalise(self) -> JobManifest:
        m = self.manifest
        m.updated_at = time.time()
        if not await self.lease.still_held():
            return self._left_to_the_new_holder(m)
        if self.stopping is None and m.complete:
            with_errors = [k for k, c in m.shards.items() if c.errors]
            async with self._lease_kept():  # the merge reads every errors part: minutes for a big job
                errors_uri = await self.store.merge_errors(self.output, with_errors)
            if not await self.lease.still_held():  # lost all the same (Redis away longer than the lease)
                return self._left_to_the_new_holder(m)
            m.errors_uri = str(errors_uri)
            m.state, m.finished_at = "succeeded", time.time()
            await self.store.put(
                self.output.child("summary.json"), _json_bytes(m.summary()), "application/json"
            )
        elif self.stopping == "cancelled":
            m.state, m.message = "cancelled", "cancelled by request"
            await self.store.clear_cancel(self.job_id)
        elif self.stopping == "interrupted":
            m.state, m.message = "queued", "interrupted; resumes where it stopped"
        else:
            m.state, m.message = "failed", self.stopping or "the input ended before every shard was complete"
        await self.store.write_manifest(m)
        await self.redis.delete(RedisKeys(self.key_prefix).batch_progress(self.job_id))
        await self.lease.release()
        log.info("job %s: %s (%s)", self.job_id, m.state, m.message or "ok")
        return m

    def _left_to_the_new_holder(self, m: JobManifest) -> JobManifest:
        """Another worker may hold the job now: its manifest is the truth, this one is stale."""
        m.message = self.lease.lost
        log.warning("job %s: %s; the manifest is left as it is", self.job_id, self.lease.lost)
        return m

    @contextlib.asynccontextmanager
    async def _lease_kept(self) -> AsyncIterator[None]:
        """Renew the lease every ``checkpoint_interval_s`` for the block, as the checkpoints did while
        the job ran: unrenewed through a long errors merge, it lapsed, another worker took the job and
        ran it again, and this one still wrote its manifest over the new holder's."""

        async def renew() -> None:
            while await self.lease.still_held():
                await asyncio.sleep(self.settings.checkpoint_interval_s)

        renewing = asyncio.create_task(renew(), name=f"lease-{self.job_id}")
        try:
            yield
        finally:
            await cancel_and_wait(renewing)
            if not renewing.cancelled() and (error := renewing.exception()) is not None:
                log.warning("job %s: renewing the lease failed: %r", self.job_id, error)

    # ---- reading and planning ----------------------------------------------------------------------
    async def _read(self) -> None:
        shard_records = self.spec.shard_records
        committed = self.book.committed
        line = -1
        cap = self.settings.max_line_bytes
        async for raw in self.store.iter_lines(S3Uri.parse(self.spec.input_uri), max_line_bytes=cap):
            line += 1
            self.bytes_read += len(raw) + 1
            self.lines_read = line + 1
            if line // shard_records in committed:
                pass
            elif isinstance(raw, OversizedLine):
                message = f"the line is {raw.size} bytes, more than max_line_bytes ({cap})"
                self._finish_error(line, "oversized", message, None, requests=0)
            else:
                self._take_line(line, raw)
            if self.lines_read % shard_records == 0:
                self._enqueue_commits(self.book.seal_through(self.lines_read))
            while self._full() and not self.stopping:
                self._room.clear()
                await self._room.wait()
            if self.stopping:
                return
        self.manifest.total_records = line + 1
        self._enqueue_commits(self.book.finish(line + 1))
        self.reader_done = True
        self._wake.set()

    def _take_line(self, line: int, raw: bytes) -> None:
        custom_id = None
        try:
            if not raw.strip():
                raise BadRecord("empty", "blank line")
            record = parse_line(line, raw)
            custom_id = record.custom_id
            plan = plan_document(record, self.settings.budget)
        except BadRecord as bad:
            self._finish_error(line, bad.reason, bad.message, bad.custom_id or custom_id, requests=0)
            return
        work = RecordWork(record, plan, self.settings.budget)
        self.works[line] = work
        self.ready.extend(work.initial_calls())
        self._wake.set()

    # ---- calls --------------------------------------------------------------------------------------
    def take(self) -> LLMCall:
        return self.ready.popleft()

    async def execute(self, call: LLMCall) -> None:
        """Make one call and feed its outcome back; never raises for a failed call."""
        if call.line not in self.works:  # its record was written off through another of its calls
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            completion = await self.pool.client.chat(
                call.messages,
                routing_key=call.routing_key,
                max_tokens=self.settings.budget.max_output_tokens,
                response_format=self._response_format,
                deadline_s=self.settings.call_deadline_s,
                validate=self._validate,
            )
        except InvalidAnswer as exc:  # tried once more on another replica already, by the client
            self.pool.observe(loop.time() - started)
            self._on_failure(call, "invalid_answer", str(exc), retry=False)
            return
        except LLMError as exc:
            self.pool.observe_failure(exc)
            self._on_failure(call, "llm_failed", f"{type(exc).__name__}: {exc}")
            return
        self.pool.observe(loop.time() - started)
        self._on_completion(call, completion)

    def _on_completion(self, call: LLMCall, completion: Completion) -> None:
        self.requests_here += 1
        work = self.works.get(call.line)
        if work is None:  # the record already failed through another of its calls
            return
        work.usage.add(completion.prompt_tokens, completion.cached_tokens, completion.completion_tokens)
        work.model = completion.model
        answer = completion.parsed
        assert isinstance(answer, ProductUnderstanding)  # what parse_product_understanding returns
        follow_up = work.on_answer(call, answer)
        if follow_up:
            # Finish started records first: their shards close sooner, so a kill loses less.
            self.ready.extendleft(reversed(follow_up))
            self._wake.set()
        elif work.result is not None:
            del self.works[call.line]
            row = output_row(
                self.job_id,
                work.record,
                work.result,
                parts=work.parts,
                model=work.model,
                usage=work.usage.as_dict(),
            )
            self._finish(call.line, row, error=False, requests=work.requests)

    def _on_failure(self, call: LLMCall, reason: ErrorReason, message: str, *, retry: bool = True) -> None:
        self.requests_here += 1
        work = self.works.get(call.line)
        if work is None:
            return
        if retry and self.stopping:
            # Left open, not tried again now: its shard stays unwritten and the resumed job tries it.
            # Written off as failed here, it completed its shard with an error row that a resume never
            # redoes, though a stop's failures are often the stop's own (replicas going too).
            return
        if retry and call.attempt + 1 < self.settings.call_attempts:
            call.attempt += 1
            work.requests += 1  # a failed try is a call made too
            self.ready.append(call)
            self._wake.set()
            return
        del self.works[call.line]
        self._finish_error(call.line, reason, message, work.record.custom_id, requests=work.requests + 1)

    def _finish_error(
        self, line: int, reason: ErrorReason, message: str, custom_id: str | None, requests: int
    ) -> None:
        self._finish(
            line, error_row(self.job_id, line, reason, message, custom_id), error=True, requests=requests
        )

    def _finish(self, line: int, row: dict[str, Any], *, error: bool, requests: int) -> None:
        self._room.set()
        self._enqueue_commits(self.book.add(line, row, error=error, requests=requests))

    # ---- commits and checkpoints -------------------------------------------------------------------
    def _enqueue_commits(self, commits: list[ShardCommit]) -> None:
        for commit in commits:
            # Counted as it is queued, not when its task first runs: the reader reads on without
            # yielding while lines come from its buffer, and saw none of the shards it had just queued.
            records = commit.counts.ok + commit.counts.errors
            self._committing += records
            task = asyncio.create_task(self._write(commit), name=f"commit-{self.job_id}-{commit.shard}")
            self._commits.add(task)
            task.add_done_callback(functools.partial(self._committed, records))

    def _committed(self, records: int, task: asyncio.Task[None]) -> None:
        """A shard's write ended (written, given up, or cancelled before it ran)."""
        self._commits.discard(task)
        self._committing -= records
        self._room.set()  # the reader may be waiting for the backlog to shrink

    async def _write(self, commit: ShardCommit) -> None:
        async with self._commit_gate:
            if not await self.lease.still_held():
                self.stop(self.lease.lost or "lost the lease")
                return
            # An S3 or Redis outage is waited out, each write retried on its own, for as long as the
            # lease is known held (beyond it another worker may hold the job); then the job fails and
            # resumes later. Four tries within 1.4 s failed a job on a 3 s Redis restart, for a worker
            # (``shopper batch worker``) to leave it failed until a person resumed it.
            policy = SinkRetry(max_wait_s=self.settings.lease_ttl_s)
            lease = self.lease

            def while_held(_: BaseException) -> bool:
                return lease.lost is None and time.monotonic() < lease.held_until

            try:
                await with_sink_retry(
                    lambda: self.store.write_shard(
                        self.output, commit.shard, commit.rows, commit.errors, commit.counts, self.job_id
                    ),
                    policy,
                    what=f"shard {commit.shard} to S3",
                    on_retry=self._write_retried,
                    retry_if=while_held,
                )
                if not await lease.still_held():  # the S3 write may have waited out most of it
                    self.stop(lease.lost or "lost the lease")
                    return
                await with_sink_retry(
                    lambda: self.signals.write(self.job_id, commit.rows),
                    policy,
                    what=f"the product signals of shard {commit.shard}",
                    on_retry=self._write_retried,
                    retry_if=while_held,
                )
            except Exception as exc:
                self.stop(f"writing shard {commit.shard} failed: {exc!r}")
                return
        self.manifest.shards[commit.shard] = commit.counts
        self._dirty = True

    def _write_retried(self, what: str, exc: BaseException) -> None:
        log.warning("job %s: writing %s failed, retrying: %r", self.job_id, what, exc)

    async def _checkpoints(self) -> None:
        interval = self.settings.checkpoint_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.checkpoint()
            except Exception as exc:  # a failed checkpoint is retried next time; the parts are durable
                log.warning("job %s: checkpoint failed: %r", self.job_id, exc)

    async def checkpoint(self) -> None:
        if not await self.lease.still_held():
            self.stop(self.lease.lost or "lost the lease")
            return
        if self._dirty:
            self._dirty = False
            self.manifest.updated_at = time.time()
            try:
                await self.store.write_manifest(self.manifest)
            except BaseException:
                self._dirty = True  # written at the next checkpoint, not only after the next shard
                raise
        if not self.stopping and await self.store.cancel_requested(self.job_id):
            log.info("job %s: cancellation requested", self.job_id)
            self.stop("cancelled")
        progress = self.progress()
        await publish_progress(self.redis, self.key_prefix, self.job_id, progress, self.settings.lease_ttl_s)

    # ---- progress ----------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """Records done / total (estimated until the input is read), rate, ETA, pool limit."""
        now = time.monotonic()
        done = self.manifest.records_done + self._committing + self.book.open_records
        self._rate_samples.append((now, done))
        t0, d0 = self._rate_samples[0]
        rate = (done - d0) / (now - t0) if now - t0 > 0.5 else 0.0
        total = self.manifest.total_records
        if total is None and self.lines_read and self.manifest.input_bytes:
            total = int(self.lines_read * self.manifest.input_bytes / max(self.bytes_read, 1))
        eta = (total - done) / rate if total is not None and rate > 0 else None
        return {
            "job_id": self.job_id,
            "done": done,
            "total": total,
            "total_exact": self.manifest.total_records is not None,
            "rate": rate,
            "eta_s": eta,
            "limit": self.pool.limit,
            "in_flight": self.in_flight,
            "errors": self.manifest.records_failed,
            "requests": self.requests_here,
            "state": "stopping" if self.stopping else "running",
        }


def _json_bytes(obj: Any) -> bytes:
    import orjson

    return orjson.dumps(obj, option=orjson.OPT_INDENT_2)
