"""Which partitions' sessions this member may write: a fencing token per partition, taken in Redis.

A revoke that times out (``revoke_timeout_s``) hands its partitions over while a session save may
already be on its way to Redis: sent, not yet applied (Redis stalled, a slow link). The lease
(``runner.assignment``) stops every save that has not started, but not one the server has not read
yet; it landed after the next owner had loaded and saved the same shoppers, appending their entries a
second time and putting back an older header.

So the first time a lease touches a partition, this member takes the partition's token
(``RedisSessionStore.take_ownership``: a random token set as the partition's, over whatever was
there), before it loads any of the partition's sessions. Every save names the tokens of the partitions
it writes, and the save script writes nothing unless each is still the partition's
(``SessionsFenced``). A save that reaches Redis after the next owner took the partition is refused
there, whatever delayed it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner


class PartitionOwnership:
    """The tokens this member holds under the current lease, on the event loop only."""

    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self._lease = 0
        """The lease the tokens belong to."""
        self._tokens: dict[int, str] = {}
        self._taking: dict[int, asyncio.Task[str]] = {}
        """One take per partition and lease: a re-arm and a poll that ask together share it (two takes
        would fence the first token's saves by this member's own second)."""

    def tokens(self, lease: int) -> Mapping[int, str]:
        """The tokens held under ``lease`` (none once it has ended)."""
        return self._tokens if lease == self._lease == self.runner.assignment.lease else {}

    def holds(self, partitions: Collection[int], lease: int) -> bool:
        """Every token of ``partitions`` is held under ``lease`` (no await: the per-poll check)."""
        return lease == self._lease and all(p in self._tokens for p in partitions)

    async def ensure(self, partitions: Collection[int], lease: int) -> bool:
        """Take the tokens of ``partitions`` not held yet under ``lease``. False: the lease ended
        meanwhile (nothing taken is kept; the next owner takes its own)."""
        runner = self.runner
        if runner.assignment.lease != lease:
            return False
        if lease != self._lease:  # the first ask of a new lease, should ``clear`` not have run yet
            self.clear()
            self._lease = lease
        wanted = [p for p in partitions if p not in self._tokens]
        if not wanted:
            return True
        tasks = [self._taking.get(p) or self._start(p) for p in wanted]
        results = await asyncio.gather(*(asyncio.shield(task) for task in tasks), return_exceptions=True)
        if runner.assignment.lease != lease:  # ``clear`` may have cancelled the takes: not a failure
            return False
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return True

    def _start(self, partition: int) -> asyncio.Task[str]:
        runner = self.runner
        lease = self._lease

        async def take() -> str:
            token = await runner.retrying(lambda: runner.store.take_ownership(partition), "ownership")
            # Kept here, before the task is done and leaves ``_taking``: kept by the caller instead,
            # an ask in between found neither and took the partition a second time, fencing the first.
            if lease == self._lease == runner.assignment.lease:
                self._tokens[partition] = token
            return token

        task = asyncio.create_task(take(), name=f"ownership {partition}")
        self._taking[partition] = task
        task.add_done_callback(functools.partial(self._forget_taking, partition))
        return task

    def _forget_taking(self, partition: int, task: asyncio.Task[str]) -> None:
        if self._taking.get(partition) is task:
            del self._taking[partition]

    def clear(self) -> None:
        """The lease ended (``RebalanceHandover``): the next owner takes the partitions' tokens."""
        for task in self._taking.values():
            task.cancel()
        self._taking.clear()
        self._tokens.clear()
