"""The embedded stack's errors: a local service (Tansu, Redis, moto, a replica, a Flink cluster or job)
could not be started, or did not do what it was asked. Each message names the service and its log."""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class StackError(ShopperError, RuntimeError):
    """A local service could not be started or stopped; the message says which and where its log is."""


class FlinkJobFailed(StackError):
    """A Flink job could not be submitted, failed, or could not be stopped with a savepoint."""
