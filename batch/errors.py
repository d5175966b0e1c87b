"""Typed batch errors; each message says what a person can do about it."""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class BatchError(ShopperError):
    """Base class of every error the batch package raises on purpose."""


class InvalidUri(BatchError):
    """Not an ``s3://bucket/key`` address."""


class JobNotFound(BatchError):
    """No manifest under the jobs prefix for this id."""


class JobLeaseHeld(BatchError):
    """Another worker is running this job (its lease in Redis is live)."""


class InputChanged(BatchError):
    """The input object changed since the job first ran: resuming would mix two inputs."""


class JobStateError(BatchError):
    """The job is in a state that does not allow the operation (e.g. resuming a succeeded job)."""


class JobExists(JobStateError):
    """A job of that id is registered already (its manifest would be replaced, its history lost)."""


class ManifestChanged(BatchError):
    """A manifest written since it was read refused a conditional write (``If-Match``): read it again
    and decide again, so that a newer state (a job that just finished) is never overwritten."""
