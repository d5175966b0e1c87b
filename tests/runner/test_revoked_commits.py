"""After a revoke's hand-over times out, the runner never saves or commits for the partitions it gave
up.

The committer was inside a durable point, waiting for S3 under ``sink_retry``, when a second member
joined; the revoke waited ``revoke_timeout_s`` and handed the partitions over uncommitted, as it
should. But once S3 came back the committer went on: it saved the revoked shoppers' session deltas
(over what their new owner holds) and committed their offsets (moving the group's position for
partitions another member owns, possibly backwards). Against the real broker, Redis and an S3 endpoint
of the test's own (``ProxiedMoto``) that is taken away and brought back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from confluent_kafka import Consumer, TopicPartition

from pipeline.checkpoint import Checkpoint
from prompt_assembly.events import ProductSnapshot, ShopperEvent
from runner.embedded import EmbeddedRunner
from runner.epochs import Epoch
from runner.session_store import RedisSessionStore
from tests.conftest import Isolated
from tests.fault_kit import ProxiedMoto, RunnerLog, stopping, wait_until
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, running
from tests.runner.test_rebalance_rearm import PARTITIONS, GroupMember

pytestmark = pytest.mark.slow

SHOPPERS = 24
"""Enough shoppers that every partition holds some."""


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (an OffsetFetch; this consumer joins nothing)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = reader.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        reader.close()


def stored_arrivals(redis_url: str, prefix: str, shoppers: list[str]) -> dict[str, int]:
    async def load() -> dict[str, int]:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            sessions = await RedisSessionStore(redis, prefix).load_many(shoppers)
            return {sid: session.arrivals for sid, session in sessions.items()}
        finally:
            await redis.aclose()

    return asyncio.run(load())


def test_a_hand_over_that_timed_out_saves_and_commits_nothing_for_the_revoked_partitions(
    isolated: Isolated, tmp_path: Path
) -> None:
    runner_log = RunnerLog()
    bootstrap = isolated.stack.kafka_bootstrap
    s3 = ProxiedMoto(tmp_path, bucket=f"revoke-{isolated.tag}")
    shoppers = [f"shopper-{i:03d}" for i in range(SHOPPERS)]
    now = time.time() - 600
    first = [cart_add(sid, now) for sid in shoppers]
    second = [cart_add(sid, now + 60) for sid in shoppers]  # past the rate limit: each one prompts
    member: GroupMember | None = None
    with stopping(s3):
        s3.start()
        sinks = isolated.sinks().model_copy(update={"s3_endpoint_url": s3.url, "s3_bucket": s3.bucket})
        settings = isolated.runner(until_drained=False, sinks=sinks, revoke_timeout_s=1.0)
        runner = EmbeddedRunner(settings, log=runner_log)
        produce_records(bootstrap, isolated.topic, first)

        async def scenario() -> tuple[list[int], dict[int, int], dict[str, int]]:
            nonlocal member
            async with running(runner) as (task,):
                acct = runner.stats.accounting
                await wait_until(
                    lambda: acct.consumed == len(first) and acct.insights == len(first) and not runner.epochs,
                    "the first events stored",
                )
                await wait_until(
                    lambda: sum(committed(bootstrap, isolated.group, isolated.topic).values()) == len(first),
                    "their commit",
                )
                before = committed(bootstrap, isolated.group, isolated.topic)
                placed = dict(runner.sessions.partition_map)
                await asyncio.to_thread(s3.stop_proxy)
                await asyncio.to_thread(produce_records, bootstrap, isolated.topic, second)
                await wait_until(
                    lambda: (
                        acct.insights == len(first) + len(second)
                        and runner.commits.busy
                        and runner.stats.sink_retries > 0
                    ),
                    "a durable point waiting for S3",
                )
                member = await asyncio.to_thread(GroupMember, bootstrap, isolated.group, isolated.topic)
                await wait_until(
                    lambda: any("handed over uncommitted" in line for line in runner_log),
                    "the hand-over to time out",
                )
                await wait_until(lambda: bool(member and member.assigned), "the new member's partitions")
                theirs = list(member.assigned)
                points = runner.checkpoint.durable_points
                await asyncio.to_thread(s3.start_proxy)
                # The durable point that waited through the outage has ended, and one after it too.
                await wait_until(
                    lambda: runner.checkpoint.durable_points >= points + 2 and not runner.commits.busy,
                    "durable points after S3 is back",
                )
                assert not task.done(), runner_log.render()
                return theirs, before, placed

        theirs, before, placed = run_showing_logs(scenario(), runner=runner_log)
        after = committed(bootstrap, isolated.group, isolated.topic)
        if member is not None:
            member.leave()

    moved = {p: (before[p], after[p]) for p in theirs if after[p] != before[p]}
    assert not moved, f"offsets committed for partitions another member owns: {moved}"
    revoked = [sid for sid, p in placed.items() if p in theirs]
    assert len(placed) == SHOPPERS and revoked
    arrivals = stored_arrivals(isolated.stack.redis_url, isolated.prefix, revoked)
    saved = {sid: n for sid, n in arrivals.items() if n != 1}
    assert not saved, f"sessions saved for shoppers of revoked partitions: {saved}"


def test_a_durable_point_saves_and_commits_nothing_of_an_epoch_whose_lease_has_ended(
    isolated: Isolated,
) -> None:
    """An epoch opened under a lease that has ended (its partitions handed over) that reaches a durable
    point is dropped there: its shopper's session is not saved and its offsets are not committed; the
    next owner replays it. An epoch of the current lease behind it is saved and committed as usual.

    The runner is never started (a rebalance cannot place an old lease's epoch before a durable point
    on cue); its parts are the real ones it makes in ``run``: the session store on the test's Redis,
    a checkpoint (no sinks), and a consumer of the test's group on the broker, which commits."""
    bootstrap = isolated.stack.kafka_bootstrap
    runner = EmbeddedRunner(isolated.runner(until_drained=False), log=lambda _: None)
    base = time.time() - 600

    def epoch_of(sid: str, partition: int, offset: int) -> None:
        """``sid``'s cart add, read at ``offset`` of ``partition``, closed as an epoch of the current
        lease (every prompt stored: complete)."""
        session = runner.sessions.use(sid, partition, runner.processor.new_session)
        event = ShopperEvent(
            event_id=f"{sid}-1",
            shopper_id=sid,
            type="add_to_cart",
            ts=base,
            product=ProductSnapshot(product_id="p-1", title="Trail shoe", price=89.0),
        )
        runner.processor.apply(session, event)
        epoch = Epoch(offsets={(isolated.topic, partition): offset}, lease=runner.assignment.lease)
        runner.close_epoch(epoch, {sid})

    async def scenario() -> tuple[int, int, dict[str, int]]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        runner.store = RedisSessionStore(redis, isolated.prefix)
        runner.checkpoint = Checkpoint([], runner.settings.sink_retry)
        runner.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": isolated.group})
        try:
            old_lease = runner.assignment.lease
            assert await runner.ownership.ensure([0], old_lease)  # as ingest takes it, before any load
            epoch_of("shopper-old", 0, 5)
            assert runner.assignment.end_lease(wait_s=1.0)  # the revoke handed partition 0 over
            assert await runner.ownership.ensure([1], runner.assignment.lease)
            epoch_of("shopper-new", 1, 3)
            await runner.commits.commit_durable()
            stored = await RedisSessionStore(redis, isolated.prefix).load_many(["shopper-old", "shopper-new"])
            return old_lease, runner.assignment.lease, {sid: s.arrivals for sid, s in stored.items()}
        finally:
            await asyncio.to_thread(runner.consumer.close)
            await redis.aclose()

    old_lease, lease, stored = asyncio.run(scenario())
    assert lease == old_lease + 1
    assert stored == {"shopper-new": 1}, f"saved for an ended lease: {stored}"
    offsets = committed(bootstrap, isolated.group, isolated.topic)
    assert offsets[1] == 3, "the current lease's epoch is committed"
    assert offsets[0] < 0, f"offset {offsets[0]} committed for partition 0 after its lease ended"
    assert not runner.epochs
