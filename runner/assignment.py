"""What this member of the consumer group owns, as the rebalance callbacks leave it.

Written on the consumer thread (``on_assign``/``on_revoke`` run inside ``consume``), read on the
event loop and by offset commits on worker threads. Two counters let work started under one
assignment notice that it has changed:

- ``generation``: +1 at every assignment and at the start of every revoke. A re-arm of an
  assignment's timers checks it after every await and does nothing more once it has changed.
- ``lease``: +1 once a revoke has handed its partitions over (committed, or given up at
  ``revoke_timeout_s``). An epoch remembers the lease it was opened under; a durable point saves
  sessions and commits offsets only while that lease is current (``holding``), so a committer that
  waited through a hand-over (on S3, under ``sink_retry``) never saves over the next owner's sessions
  or moves the group's offsets of partitions it gave up.

The end of a lease waits for a commit under way only so long (``end_lease``): librdkafka can hold a
synchronous commit until the group's rebalance moves on (a commit deferred while the coordinator is
away), and the rebalance waits for the revoke callback that ends the lease. Waiting without a bound
deadlocked the consumer thread and the committer (a broker restart mid-stream, seen once in CI).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from confluent_kafka import TopicPartition


class Assignment:
    def __init__(self) -> None:
        self.partitions: list[TopicPartition] = []
        self.generation = 0
        self.lease = 0
        self._lease_lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.partitions)

    def numbers(self) -> list[int]:
        return sorted(tp.partition for tp in self.partitions)

    @contextmanager
    def holding(self, lease: int) -> Iterator[bool]:
        """True inside while ``lease`` is current; the lease does not end while the block runs, unless
        ``end_lease`` gives up waiting for it (an offset commit inside it is not overtaken by the end
        of the hand-over)."""
        with self._lease_lock:
            yield lease == self.lease

    def end_lease(self, wait_s: float) -> bool:
        """The revoked partitions are handed over: nothing opened under the old lease is saved or
        committed after this returns, except a commit already under way that does not finish within
        ``wait_s`` (False). That commit was started under the lease, after its durable point, so its
        offsets are durable: the broker fences it if the group's generation has moved on, and at worst
        it rewinds a partition's offsets, whose replay the answer ledger answers without a call."""
        acquired = self._lease_lock.acquire(timeout=wait_s)
        try:
            self.lease += 1
        finally:
            if acquired:
                self._lease_lock.release()
        return acquired
