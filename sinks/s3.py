"""Results to S3 as gzip JSONL, partitioned by event date and hour, for analytics.

Records are buffered and flushed when ``s3_max_records`` are waiting or the oldest is ``s3_max_age_s``
old (``flush`` forces it). Object keys are derived from the content (a hash of the sorted request ids
of the batch), so a retried flush overwrites the same object instead of writing a duplicate.
Partitions use the event time of the newest event in the prompt, not the wall clock, so replays land
in the same partition. Across a crash between an S3 flush and the offset commit a record can appear in
two objects; ``request_id`` is the table's key, and readers dedupe on it (the layout and what a reader
may rely on: docs/contracts.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import xxhash
from aiobotocore.session import get_session
from botocore.exceptions import ClientError, EndpointConnectionError

from prompt_assembly.records import EnrichmentResult
from sinks.config import SinkSettings
from sinks.errors import S3Unreachable

log = logging.getLogger(__name__)


def partition_of(result: EnrichmentResult, prefix: str) -> str:
    stamp = time.gmtime(result.last_event_ts)
    return f"{prefix}/kind={result.kind}/dt={time.strftime('%Y-%m-%d', stamp)}/hour={stamp.tm_hour:02d}"


def object_key(partition: str, records: Sequence[EnrichmentResult]) -> str:
    """The same records, the same key (a replay overwrites its own object, never adds one). The ids
    are hashed as a JSON array: joined by newlines, a shopper id holding a newline made one record's
    id read as two, and two different batches shared a key, the later object replacing the earlier."""
    digest = xxhash.xxh64(orjson.dumps(sorted(r.request_id for r in records))).hexdigest()
    return f"{partition}/part-{digest}.jsonl.gz"


def encode_jsonl_gz(records: Sequence[EnrichmentResult]) -> bytes:
    body = b"".join(orjson.dumps(r.model_dump(mode="json")) + b"\n" for r in records)
    return gzip.compress(body, compresslevel=5, mtime=0)


S3_ENDPOINT_SETTING = (
    "the sinks' s3_endpoint_url (SINK_S3_ENDPOINT_URL, RUNNER_SINKS__S3_ENDPOINT_URL or "
    "FLINK_JOB_SINKS__S3_ENDPOINT_URL; a stack's comes from STACK_S3_ENDPOINT_URL)"
)
"""Where the sinks' endpoint may have come from: the sink sees the settings, not which variable set them."""

KEYS_KEPT = 1_000
"""Recent object keys kept for inspection; a long run must not grow memory with every flush."""


class S3InsightSink:
    name = "s3"

    def __init__(self, settings: SinkSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds for the age-based flush (tests pass their own)."""
        self.settings = settings
        self._clock = clock
        self._buffer: list[EnrichmentResult] = []
        self._oldest: float | None = None
        self._lock = asyncio.Lock()
        self._exit = contextlib.AsyncExitStack()
        self._client: Any = None
        self.keys_written: deque[str] = deque(maxlen=KEYS_KEPT)
        self.records_written = 0

    async def start(self) -> None:
        if self._client is None:
            session = get_session()
            self._client = await self._exit.enter_async_context(
                session.create_client("s3", **self.settings.s3_client_kwargs())
            )

    async def ensure_bucket(self) -> None:
        """Create the bucket only when S3 says it is not there (404). A 403 goes on: ``HeadBucket`` needs
        ``s3:ListBucket``, which a writer's least-privilege role often lacks, and its writes tell whether
        it may write (before, any failure here was answered with a ``CreateBucket``, which such a role
        may not send either, so the engine never started). Outside us-east-1 the bucket is created in
        the client's region (S3 refuses a ``CreateBucket`` without that ``LocationConstraint``)."""
        await self.start()
        bucket = self.settings.s3_bucket
        try:
            await self._client.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            status = _status(exc)
            if status == 403:
                log.warning("s3: may not check bucket %r (403); its writes will tell", bucket)
                return
            if status != 404:
                raise
        region = self._client.meta.region_name
        where = {} if region in (None, "us-east-1") else {"LocationConstraint": region}
        try:
            await self._client.create_bucket(
                Bucket=bucket, **({"CreateBucketConfiguration": where} if where else {})
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":  # made meanwhile
                raise

    async def open(self) -> None:
        """The sink's start, and its first contact with S3: an endpoint where nothing answers is an
        ``S3Unreachable`` that names the setting and the endpoint. The engines still retry it under their
        ``SinkRetry`` (an S3 starting beside the engine is waited for, as before), so only the error they
        stop with past that wait changes: one line, not botocore's traceback. Later writes and flushes
        raise botocore's own errors into the same retry policy, unchanged."""
        try:
            await self.ensure_bucket()
        except EndpointConnectionError as exc:
            raise S3Unreachable(S3_ENDPOINT_SETTING, self.settings.s3_endpoint_url, exc) from exc

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def due(self) -> bool:
        """True when the buffer should be flushed by size or age."""
        if not self._buffer:
            return False
        return len(self._buffer) >= self.settings.s3_max_records or (
            self._oldest is not None and self._clock() - self._oldest >= self.settings.s3_max_age_s
        )

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        """Buffer ``results``. Never fails: a full buffer is flushed opportunistically, and a failed
        flush leaves what it did not write buffered for the next ``flush`` (which the engines retry and
        wait for before they commit), so a retried ``write`` can never buffer a record twice."""
        if results and self._oldest is None:
            self._oldest = self._clock()
        self._buffer.extend(results)
        if len(self._buffer) >= self.settings.s3_max_records:
            try:
                await self.flush()
            except Exception as exc:  # kept buffered: the engine's flush before its commit retries it
                log.warning("S3 flush of a full buffer failed, kept for the next flush: %r", exc)

    async def flush(self) -> None:
        async with self._lock:
            if not self._buffer:
                return
            await self.start()
            # Grouped before the buffer is taken: a record that cannot be placed raises with every
            # record still buffered (taken first, a failed grouping lost the whole batch, and the retried
            # flush found nothing to write, so the commit went ahead).
            groups: dict[str, list[EnrichmentResult]] = defaultdict(list)
            for record in self._buffer:
                groups[partition_of(record, self.settings.s3_prefix)].append(record)
            batch_oldest = self._oldest
            self._buffer, self._oldest = [], None
            written: set[str] = set()
            try:
                outcomes = await asyncio.gather(
                    *(self._put(part, records, written) for part, records in groups.items()),
                    return_exceptions=True,
                )
            except BaseException:  # cancelled: gather has stopped every put by now
                self._give_back(groups, written, batch_oldest)
                raise
            error = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
            if error is not None:
                self._give_back(groups, written, batch_oldest)
                raise error

    def _give_back(
        self, groups: dict[str, list[EnrichmentResult]], written: set[str], oldest: float | None
    ) -> None:
        """Nothing is lost: the partitions not written go back in front, and the caller's commit waits
        for a flush. Only those: a written partition given back was written again by the next flush,
        with more records under another key, so its records stood in two objects."""
        unwritten = [record for part, records in groups.items() if part not in written for record in records]
        self._buffer[:0] = unwritten
        if unwritten:  # as old as the batch they came with, or as what was buffered meanwhile
            ages = [t for t in (oldest, self._oldest) if t is not None]
            self._oldest = min(ages) if ages else self._clock()

    async def _put(self, partition: str, records: list[EnrichmentResult], written: set[str]) -> None:
        records.sort(key=lambda r: r.request_id)
        key = object_key(partition, records)
        await self._client.put_object(
            Bucket=self.settings.s3_bucket,
            Key=key,
            Body=encode_jsonl_gz(records),
            ContentType="application/x-ndjson",
            ContentEncoding="gzip",
        )
        written.add(partition)
        self.keys_written.append(key)
        self.records_written += len(records)

    async def close(self) -> None:
        """Flush, then close the client even when that flush fails (S3 unreachable at shutdown): the
        failure is raised, and the client's connections do not outlive the sink."""
        try:
            await self.flush()
        finally:
            await self._exit.aclose()
            self._client = None


def _status(error: ClientError) -> int | None:
    """The HTTP status of a failed S3 call (a ``HeadBucket`` has no error body, only its status)."""
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None
