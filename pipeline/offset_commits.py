"""Offset commits that wait out a broker or group coordinator that is away.

A commit is the last step of a durable point: everything before it is already stored. If the broker
is restarting (or the group's coordinator is moving), librdkafka answers the synchronous commit with a
transient error (``_WAIT_COORD``, ``_TRANSPORT``, ``COORDINATOR_NOT_AVAILABLE``, ...). Failing the runner
there would throw away a durable point for nothing, so such a commit is retried under the same policy
as the stores (``pipeline.sink_retry.SinkRetry``): waited for up to ``max_wait_s``, never skipped.
Committing the same offsets again is idempotent. A member the group has fenced (its session expired
while the broker was away, or a rebalance is under way) skips the commit and goes on: the consumer
rejoins and whoever owns the partitions next replays them. Any other error (an authorisation error) is
raised at once: the runner stops and the next owner replays.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException

from pipeline.sink_retry import SinkRetry, with_sink_retry

TRANSIENT = frozenset(
    {
        KafkaError._WAIT_COORD,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
    }
)


FENCED = frozenset(
    {
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.FENCED_INSTANCE_ID,
    }
)
"""The group moved on without this member (its session expired while the broker was away, or a
rebalance is under way): its commit is refused. The consumer rejoins by itself; the offsets not
committed are replayed by whoever owns the partitions next (sinks are idempotent), so the right answer
is to skip this commit, not to stop the runner."""


def is_fenced(exc: BaseException) -> bool:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(error, KafkaError) and error.code() in FENCED


def is_transient(exc: BaseException) -> bool:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if not isinstance(error, KafkaError) or error.code() in FENCED:
        return False
    return error.code() in TRANSIENT or error.retriable()


async def commit_waiting_for_broker(
    commit: Callable[[], None],
    policy: SinkRetry,
    *,
    on_retry: Callable[[str, BaseException], None] | None = None,
    on_fenced: Callable[[BaseException], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Run the blocking ``commit()`` off the loop, retrying transient Kafka errors under ``policy``
    (the stores' policy). Returns False when the group fenced this member (the commit is skipped, see
    ``FENCED``); any other error, or one that outlasts the policy, is raised."""
    try:
        await with_sink_retry(
            lambda: asyncio.to_thread(commit),
            policy,
            what="offset commit",
            on_retry=on_retry,
            retry_if=is_transient,
            clock=clock,
        )
    except KafkaException as exc:
        if not is_fenced(exc):
            raise
        if on_fenced is not None:
            on_fenced(exc)
        return False
    return True
