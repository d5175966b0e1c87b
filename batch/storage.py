"""S3 side of batch jobs (aiobotocore): manifests, input lines, output parts, errors, cancel markers.

Layout, with ``{jobs}`` = ``s3://{sink bucket}/{jobs_prefix}/{job_id}`` and ``{out}`` the job's
output URI::

    {jobs}/manifest.json          the checkpoint (``JobManifest``)
    {jobs}/cancel                 present = cancellation requested
    {out}/part-00000.jsonl        output rows of shard 0 (written once per shard: deterministic key)
    {out}/errors/part-00000.jsonl error rows of shard 0 (only when it has any)
    {out}/errors.jsonl            every error row, merged when the job succeeds (a multipart upload)
    {out}/summary.json            the final manifest summary

A part's object metadata carries its shard's counts, so a shard whose part was written just before a
kill (after the last manifest checkpoint) is adopted on resume instead of redone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Self

import orjson
from aiobotocore.session import get_session
from botocore.exceptions import ClientError
from pydantic import ValidationError

from batch.errors import InvalidUri, JobExists, JobNotFound, ManifestChanged
from batch.lines import LineSplitter, OversizedLine
from batch.manifest import JobManifest, ShardCounts
from batch.multipart import PART_BYTES, MultipartObjectWriter
from sinks.config import SinkSettings

log = logging.getLogger(__name__)

_PART = "part-{:05d}.jsonl"
_PART_NAME = re.compile(r"part-(\d+)\.jsonl")
"""An output part's name (``_PART``); any other object under the output is not a part."""


@dataclass(frozen=True, slots=True)
class S3Uri:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        if not uri.startswith("s3://"):
            raise InvalidUri(f"{uri!r} is not an s3://bucket/key address")
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise InvalidUri(f"{uri!r} has no bucket")
        return cls(bucket, key)

    def child(self, name: str) -> S3Uri:
        base = self.key.rstrip("/")
        return S3Uri(self.bucket, f"{base}/{name}" if base else name)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def part_key(output: S3Uri, shard: int) -> S3Uri:
    return output.child(_PART.format(shard))


def errors_part_key(output: S3Uri, shard: int) -> S3Uri:
    return output.child("errors/" + _PART.format(shard))


def encode_jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


class JobStore:
    def __init__(self, sinks: SinkSettings, jobs_prefix: str = "batch-jobs") -> None:
        self.sinks = sinks
        self.jobs_root = S3Uri(sinks.s3_bucket, jobs_prefix.strip("/"))
        self._exit = contextlib.AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._client is None:
            self._client = await self._exit.enter_async_context(
                get_session().create_client("s3", **self.sinks.s3_client_kwargs())
            )

    async def close(self) -> None:
        await self._exit.aclose()
        self._client = None

    @property
    def client(self) -> Any:
        assert self._client is not None, "call start() or use 'async with' first"
        return self._client

    def job_dir(self, job_id: str) -> S3Uri:
        return self.jobs_root.child(job_id)

    # ---- manifests --------------------------------------------------------------------------------
    async def read_manifest(self, job_id: str) -> JobManifest:
        return (await self.read_manifest_tagged(job_id))[0]

    async def read_manifest_tagged(self, job_id: str) -> tuple[JobManifest, str]:
        """The manifest and its ETag, for a write that must not replace a newer one
        (``write_manifest(..., if_match=etag)``)."""
        uri = self.job_dir(job_id).child("manifest.json")
        try:
            response = await self.client.get_object(Bucket=uri.bucket, Key=uri.key)
            async with response["Body"] as body:
                raw = bytes(await body.read())
        except ClientError as exc:
            if _not_found(exc):
                raise JobNotFound(f"no batch job {job_id!r} (looked for {uri})") from None
            raise
        return JobManifest.model_validate_json(raw), str(response["ETag"])

    async def write_manifest(
        self, manifest: JobManifest, *, new: bool = False, if_match: str | None = None
    ) -> None:
        """``new``: only if the job has no manifest yet (a conditional write: of two submits under one
        id, exactly one succeeds); else ``JobExists``. ``if_match``: only over the manifest of that ETag
        (``If-Match``: someone who wrote since wins); else ``ManifestChanged``."""
        uri = self.job_dir(manifest.job_id).child("manifest.json")
        body = manifest.model_dump_json().encode()
        try:
            await self.put(uri, body, "application/json", only_new=new, if_match=if_match)
        except ClientError as exc:
            if not _precondition_failed(exc):
                raise
            if if_match is not None:
                raise ManifestChanged(
                    f"the manifest of job {manifest.job_id} changed since it was read"
                ) from None
            raise JobExists(f"job {manifest.job_id} exists already") from None

    def output_claim(self, output: S3Uri) -> S3Uri:
        """Where the job that owns ``output`` is named: one object per output, under the registry."""
        digest = hashlib.sha256(str(output).encode()).hexdigest()[:32]
        return self.jobs_root.child("outputs").child(f"{digest}.json")

    async def claim_output(self, output: S3Uri, job_id: str) -> str | None:
        """Make ``job_id`` the owner of ``output`` unless a job owns it already (a conditional write, so
        of two submits at one instant exactly one wins); returns the owner found, or None."""
        uri = self.output_claim(output)
        body = orjson.dumps({"output": str(output), "job_id": job_id})
        try:
            await self.put(uri, body, "application/json", only_new=True)
        except ClientError as exc:
            if not _precondition_failed(exc):
                raise
            return str(orjson.loads(await self.read(uri))["job_id"])
        return None

    async def release_output(self, output: S3Uri) -> None:
        """Remove ``output``'s claim (a submit that claimed it lost the race for its job id)."""
        uri = self.output_claim(output)
        await self.client.delete_object(Bucket=uri.bucket, Key=uri.key)

    async def list_manifests(self) -> list[JobManifest]:
        manifests = []
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = self.jobs_root.key + "/"
        async for page in paginator.paginate(Bucket=self.jobs_root.bucket, Prefix=prefix, Delimiter="/"):
            for entry in page.get("CommonPrefixes", []):
                job_id = entry["Prefix"][len(prefix) :].rstrip("/")
                try:
                    manifests.append(await self.read_manifest(job_id))
                except JobNotFound:
                    continue
                except ValidationError as exc:  # one unreadable manifest must not hide every other job
                    log.error("batch job %s: its manifest is not readable, skipped: %s", job_id, exc)
        return sorted(manifests, key=lambda m: m.spec.submitted_at)

    # ---- cancellation -----------------------------------------------------------------------------
    async def request_cancel(self, job_id: str) -> None:
        await self.put(self.job_dir(job_id).child("cancel"), b"", "text/plain")

    async def cancel_requested(self, job_id: str) -> bool:
        return await self.exists(self.job_dir(job_id).child("cancel"))

    async def clear_cancel(self, job_id: str) -> None:
        uri = self.job_dir(job_id).child("cancel")
        await self.client.delete_object(Bucket=uri.bucket, Key=uri.key)

    # ---- input ------------------------------------------------------------------------------------
    async def head(self, uri: S3Uri) -> tuple[str, int]:
        """(ETag, size) of an object."""
        try:
            head = await self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if _not_found(exc):
                raise FileNotFoundError(f"{uri} does not exist") from None
            raise
        return str(head["ETag"]), int(head["ContentLength"])

    async def iter_lines(
        self, uri: S3Uri, *, max_line_bytes: int, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes | OversizedLine]:
        """Every line of the object, without its newline (a last line without one included); a line
        longer than ``max_line_bytes`` comes as an ``OversizedLine`` and is never held whole
        (``batch.lines``: linear time, memory at most the cap plus one chunk)."""
        response = await self.client.get_object(Bucket=uri.bucket, Key=uri.key)
        splitter = LineSplitter(max_line_bytes)
        async with response["Body"] as body:
            while chunk := await body.read(chunk_size):
                for line in splitter.feed(chunk):
                    yield line
        for line in splitter.end():
            yield line

    # ---- output -----------------------------------------------------------------------------------
    async def put(
        self,
        uri: S3Uri,
        body: bytes,
        content_type: str,
        meta: dict[str, str] | None = None,
        *,
        only_new: bool = False,
        if_match: str | None = None,
    ) -> None:
        """S3's conditional writes, refused with 412: ``only_new`` (``If-None-Match: *``) where the key
        exists, ``if_match`` (``If-Match``) where the object's ETag is no longer that one."""
        condition = {"IfNoneMatch": "*"} if only_new else {}
        if if_match is not None:
            condition["IfMatch"] = if_match
        for attempt in range(CONDITIONAL_CONFLICT_TRIES):
            try:
                await self.client.put_object(
                    Bucket=uri.bucket,
                    Key=uri.key,
                    Body=body,
                    ContentType=content_type,
                    Metadata=meta or {},
                    **condition,
                )
                return
            except ClientError as exc:
                last_try = attempt == CONDITIONAL_CONFLICT_TRIES - 1
                if not condition or not _conditional_conflict(exc) or last_try:
                    raise
            await asyncio.sleep(0.05 * (attempt + 1))

    async def exists(self, uri: S3Uri) -> bool:
        try:
            await self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if _not_found(exc):
                return False
            raise
        return True

    async def write_shard(
        self,
        output: S3Uri,
        shard: int,
        rows: list[dict[str, Any]],
        errors: list[dict[str, Any]],
        counts: ShardCounts,
        job_id: str,
    ) -> None:
        """Errors part first, then the output part: a part's existence means the shard is complete. The
        part names its job (``written_shards`` adopts only a job's own parts). A shard with no errors
        removes an errors part an earlier try left (killed before its output part, then redone): it
        would list as failed a line the output part answers."""
        errors_key = errors_part_key(output, shard)
        if errors:
            await self.put(errors_key, encode_jsonl(errors), "application/x-ndjson")
        else:
            await self.client.delete_object(Bucket=errors_key.bucket, Key=errors_key.key)
        meta = {
            "ok": str(counts.ok),
            "errors": str(counts.errors),
            "requests": str(counts.requests),
            "job": job_id,
        }
        await self.put(part_key(output, shard), encode_jsonl(rows), "application/x-ndjson", meta)

    async def part_shards(self, output: S3Uri) -> list[tuple[int, str]]:
        """(shard, key) of every output part under ``output`` (``part-NNNNN.jsonl``; other names
        ignored)."""
        found: list[tuple[int, str]] = []
        prefix = output.key.rstrip("/") + "/" if output.key else ""
        paginator = self.client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=output.bucket, Prefix=prefix + "part-", Delimiter="/"):
            for entry in page.get("Contents", []):
                match = _PART_NAME.fullmatch(entry["Key"][len(prefix) :])
                if match is not None:
                    found.append((int(match.group(1)), entry["Key"]))
        return found

    async def written_shards(
        self, output: S3Uri, job_id: str, known: set[int] | frozenset[int] = frozenset()
    ) -> dict[int, ShardCounts]:
        """Shards of ``job_id`` whose output part exists but are not in ``known``, with the counts from
        the part's metadata. A part another job wrote (the same output given to two jobs) is never
        taken as this job's: it took that job's answers as its own and skipped its own input's lines."""
        found: dict[int, ShardCounts] = {}
        for shard, key in await self.part_shards(output):
            if shard in known:
                continue
            head = await self.client.head_object(Bucket=output.bucket, Key=key)
            meta = head.get("Metadata", {})
            if meta.get("job") != job_id:
                continue
            found[shard] = ShardCounts(
                ok=int(meta.get("ok", 0)),
                errors=int(meta.get("errors", 0)),
                requests=int(meta.get("requests", 0)),
            )
        return found

    async def read(self, uri: S3Uri) -> bytes:
        """The whole object (small ones: manifests, claims, parts)."""
        response = await self.client.get_object(Bucket=uri.bucket, Key=uri.key)
        async with response["Body"] as body:
            return bytes(await body.read())

    async def read_jsonl(self, uri: S3Uri) -> list[dict[str, Any]]:
        raw = await self.read(uri)
        return [orjson.loads(line) for line in raw.splitlines() if line.strip()]

    async def merge_errors(
        self, output: S3Uri, shards: list[int], *, part_bytes: int = PART_BYTES, chunk_size: int = 1 << 20
    ) -> S3Uri:
        """Concatenate the error parts of ``shards`` (in shard order) into ``{out}/errors.jsonl``.

        Streamed: each errors part is read a chunk at a time into a multipart upload, so memory stays at
        about two ``part_bytes`` however many rows failed (a catalogue of mostly broken lines has
        gigabytes of them, more than a worker holds and more than S3 takes in one PUT). The object
        appears whole or not at all: a failure aborts the upload, and a resumed job merges again."""
        target = output.child("errors.jsonl")
        async with MultipartObjectWriter(self.client, target, "application/x-ndjson", part_bytes) as merged:
            for shard in sorted(shards):
                source = errors_part_key(output, shard)
                response = await self.client.get_object(Bucket=source.bucket, Key=source.key)
                async with response["Body"] as body:
                    while chunk := await body.read(chunk_size):
                        await merged.write(chunk)
        return target


CONDITIONAL_CONFLICT_TRIES = 5
"""S3 answers two conditional writes of one key at once with 409 ``ConditionalRequestConflict`` to one
of them, to be tried again (then a 412 says who won); MinIO and moto answer 412 at once."""


def _conditional_conflict(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) == "ConditionalRequestConflict"


def _precondition_failed(exc: ClientError) -> bool:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(error.get("Code", "")) in ("PreconditionFailed", "412") or status == 412


def _not_found(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")
