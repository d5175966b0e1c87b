"""Liveness and readiness of the embedded runner, as ``/health/live`` and ``/health/ready`` answer them.

- **Live**: the event loop answers (the handler runs on it) and the runner has not failed. A runner
  that failed stops on its own (it never commits past the failure); an orchestrator that sees it not
  live restarts it, and the restart replays from the last commit.
- **Ready**: live, started, owns at least one partition, and not stopping. A member without
  partitions (more members than partitions, or between a revoke and the next assignment) is alive but
  not ready: it is doing no work. A store that is down does not make the runner unready: it waits
  (``sink_retry``) and ``sink_retries`` / ``last_commit_age_seconds`` show it; readiness turns false
  only once the wait is over and the runner fails.
"""

from __future__ import annotations

import time
from typing import Protocol

from pydantic import BaseModel

from llm_client.client import LLMClient
from pipeline.enrichment import Enricher
from runner.progress import RunnerStats


class RunnerView(Protocol):
    """What the metrics and the health check read from a runner (``EmbeddedRunner`` implements it)."""

    @property
    def stats(self) -> RunnerStats: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def paused(self) -> bool: ...
    @property
    def started_at(self) -> float:
        """Monotonic time the runner was made."""
        ...

    @property
    def llm_client(self) -> LLMClient | None: ...
    @property
    def enrichment(self) -> Enricher | None:
        """The enrichment step (its overload counts and admission gate); None before ``run``."""
        ...

    @property
    def failure(self) -> BaseException | None: ...
    @property
    def stopping(self) -> bool: ...
    def assigned_partitions(self) -> list[int]: ...
    def session_resets(self) -> int:
        """Answers that replaced another session's signal (``pipeline.checkpoint.Checkpoint``)."""
        ...

    def results_too_large(self) -> int:
        """Results the Kafka sink could not write for their size (``pipeline.checkpoint.Checkpoint``)."""
        ...

    def lag_by_partition(self) -> dict[int, int]:
        """From the watermarks the consumer last saw (no broker round trip)."""
        ...


class HealthReport(BaseModel):
    live: bool
    ready: bool
    why_not_ready: str | None
    partitions: list[int]
    in_flight: int
    last_commit_age_s: float | None
    failure: str | None
    """The exception type only: its message may name an address with credentials."""


def readiness(view: RunnerView) -> HealthReport:
    failure = view.failure
    partitions = view.assigned_partitions()
    why: str | None = None
    if failure is not None:
        why = "failed"
    elif view.stopping:
        why = "stopping"
    elif not partitions:
        why = "no partitions assigned"
    last = view.stats.last_commit_at
    return HealthReport(
        live=failure is None,
        ready=why is None,
        why_not_ready=why,
        partitions=partitions,
        in_flight=view.in_flight,
        last_commit_age_s=None if last is None else round(time.monotonic() - last, 3),
        failure=None if failure is None else type(failure).__name__,  # the message may hold an address
    )
