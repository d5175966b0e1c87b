"""Which job's request goes next on a shared endpoint pool (pure, no I/O).

Jobs share one pool's concurrency limit (set by the AIMD controller, capped by the pool's capacity
budget). Between priority levels the split is strict: a higher level takes every slot it has work
for, and a lower level gets what is left; within a level, slots are water-filled so equal jobs get
equal shares and a job with little work leaves its share to the others. Nothing is preempted: when a
higher-priority job arrives, a lower one keeps its in-flight calls and simply gets no new slots until
its share comes back. Jobs start in order of priority (higher first), then submission time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby


@dataclass(frozen=True, slots=True)
class JobDemand:
    job_id: str
    priority: int
    submitted_at: float
    in_flight: int
    ready: int
    """Calls that could be dispatched now."""

    @property
    def wants(self) -> int:
        return self.in_flight + self.ready


def start_order(jobs: Sequence[JobDemand]) -> list[JobDemand]:
    """Higher priority first, then earlier submission, then job id (deterministic)."""
    return sorted(jobs, key=lambda j: (-j.priority, j.submitted_at, j.job_id))


def allocate(limit: int, jobs: Sequence[JobDemand]) -> dict[str, int]:
    """Slots per job: the sum is at most ``limit`` and no job gets more than it ``wants``."""
    shares = {j.job_id: 0 for j in jobs}
    left = max(limit, 0)
    for _, level_iter in groupby(start_order(jobs), key=lambda j: j.priority):
        level = list(level_iter)
        want = {j.job_id: j.wants for j in level}
        open_jobs = [j for j in level if want[j.job_id] > 0]
        while left > 0 and open_jobs:
            each = max(left // len(open_jobs), 1)
            for job in list(open_jobs):
                give = min(each, want[job.job_id] - shares[job.job_id], left)
                shares[job.job_id] += give
                left -= give
                if shares[job.job_id] >= want[job.job_id]:
                    open_jobs.remove(job)
                if left == 0:
                    break
        if left == 0:
            break
    return shares


def pick_next(limit: int, jobs: Sequence[JobDemand]) -> str | None:
    """The job whose call should be dispatched next, or None (pool full, or no ready work).

    The pick is the job furthest below its allocated share, in start order on ties. Since a share
    never exceeds a job's in-flight plus ready calls, free slots and ready work always give a pick.
    """
    if sum(j.in_flight for j in jobs) >= limit:
        return None
    shares = allocate(limit, jobs)
    ready = [j for j in start_order(jobs) if j.ready > 0]
    if not ready:
        return None
    below = [j for j in ready if j.in_flight < shares[j.job_id]]
    if not below:
        return None
    return max(below, key=lambda j: shares[j.job_id] - j.in_flight).job_id
