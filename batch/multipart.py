"""One S3 object written from a stream of chunks in bounded memory (S3 multipart upload).

A PUT body is held whole, and S3 refuses one over 5 GB: an object that grows with the input (the merged
``errors.jsonl`` of a catalogue of mostly broken lines) is written part by part instead, holding about
two parts at a time however large the object grows.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batch.storage import S3Uri

log = logging.getLogger(__name__)

MIN_PART_BYTES = 5 * 1024 * 1024
"""S3's smallest part but the last (``EntityTooSmall`` at completion otherwise); MinIO and moto agree."""

PART_BYTES = 8 * 1024 * 1024
"""A part's size: memory held is about twice this; S3's 10,000 parts make 80 GB the largest object."""

_CHECKSUM = "CRC32"
"""Declared when the upload starts and sent with every part: botocore checksums each part by default,
and S3 wants the parts' checksums to match the algorithm the upload was created with."""


class MultipartObjectWriter:
    """Appends bytes to one object; nothing is visible at ``uri`` until ``close`` (S3 shows a multipart
    object only once completed). An object smaller than one part is one plain PUT. Used as an async
    context manager, a failure aborts the upload, so no part is left stored (and billed) with no object.
    Not safe for concurrent ``write`` calls."""

    def __init__(self, client: Any, uri: S3Uri, content_type: str, part_bytes: int = PART_BYTES) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes {part_bytes} is below S3's minimum part size ({MIN_PART_BYTES})")
        self.client = client
        self.uri = uri
        self.content_type = content_type
        self.part_bytes = part_bytes
        self.upload_id: str | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._parts: list[dict[str, Any]] = []

    async def __aenter__(self) -> MultipartObjectWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            await self.abort()
            return
        try:
            await self.close()
        except BaseException:
            await self.abort()
            raise

    async def write(self, data: bytes) -> None:
        """Buffer ``data``; a full part is uploaded before this returns (so memory stays bounded)."""
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= self.part_bytes:
            await self._upload_part()

    async def close(self) -> None:
        """Complete the object: every byte written, in order; on an error, ``abort`` is the caller's."""
        if self.upload_id is None:  # never filled a part: one plain PUT (an empty object included)
            body = b"".join(self._chunks)
            self._chunks.clear()
            await self.client.put_object(
                Bucket=self.uri.bucket, Key=self.uri.key, Body=body, ContentType=self.content_type
            )
            return
        if self._buffered:
            await self._upload_part()  # the last part may be smaller than the minimum
        await self.client.complete_multipart_upload(
            Bucket=self.uri.bucket,
            Key=self.uri.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self._parts},
        )
        self.upload_id = None

    async def abort(self) -> None:
        """Drop the parts uploaded so far. Never raises: it runs while another error propagates; an abort
        S3 refuses is logged with the upload id (a bucket lifecycle rule,
        ``AbortIncompleteMultipartUpload``, removes such leftovers)."""
        self._chunks.clear()
        self._buffered = 0
        if self.upload_id is None:
            return
        upload_id, self.upload_id = self.upload_id, None
        try:
            await self.client.abort_multipart_upload(
                Bucket=self.uri.bucket, Key=self.uri.key, UploadId=upload_id
            )
        except Exception as exc:
            log.warning("could not abort the multipart upload %s of %s: %r", upload_id, self.uri, exc)

    async def _upload_part(self) -> None:
        if self.upload_id is None:
            started = await self.client.create_multipart_upload(
                Bucket=self.uri.bucket,
                Key=self.uri.key,
                ContentType=self.content_type,
                ChecksumAlgorithm=_CHECKSUM,
            )
            self.upload_id = str(started["UploadId"])
        number = len(self._parts) + 1
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        answer = await self.client.upload_part(
            Bucket=self.uri.bucket,
            Key=self.uri.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
            ChecksumAlgorithm=_CHECKSUM,
        )
        part: dict[str, Any] = {"ETag": answer["ETag"], "PartNumber": number}
        with contextlib.suppress(KeyError):
            part["ChecksumCRC32"] = answer["ChecksumCRC32"]
        self._parts.append(part)
