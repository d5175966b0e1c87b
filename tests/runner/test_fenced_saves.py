"""A session save sent before a hand-over, and delayed past it, never lands over the next owner's.

The revoke's hand-over waits ``revoke_timeout_s`` for the durable point; past it the partitions go
over uncommitted, and the lease stops every save that has not started. A save already sent was not
stopped: held on a stalled link (here a proxy of the test's own, stopped with SIGSTOP, in front of a
redis-server of the test's own), it reached Redis after the next owner had loaded and saved the same
shopper, appended the replayed event a second time and put back the older header. The store now
refuses it by the partition's fencing token (``runner.ownership``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from confluent_kafka import TopicPartition

from pipeline.checkpoint import Checkpoint
from prompt_assembly.events import ShopperEvent, parse_event
from runner.embedded import EmbeddedRunner
from runner.epochs import Epoch
from runner.errors import OwnershipLost
from runner.session_store import RedisSessionStore, SessionDelta
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis, TcpProxy, stopping, wait_until
from tests.runner.kit import cart_add, view

pytestmark = pytest.mark.slow

SHOPPER, PARTITION = "shopper-moved", 0


async def owning_with_an_epoch(
    runner: EmbeddedRunner, redis: aioredis.Redis, isolated: Isolated, event: ShopperEvent
) -> None:
    """``runner`` on ``redis`` as a poll of its lease leaves it: the partition's token taken (as ingest
    takes it, before any load) and ``event`` applied to the shopper in a closed epoch."""
    runner.store = RedisSessionStore(redis, isolated.prefix)
    runner.checkpoint = Checkpoint([], runner.settings.sink_retry)
    lease = runner.assignment.lease
    assert await runner.ownership.ensure([PARTITION], lease)
    session = runner.sessions.use(SHOPPER, PARTITION, runner.processor.new_session)
    runner.processor.apply(session, event)
    runner.close_epoch(Epoch(offsets={(isolated.topic, PARTITION): 1}, lease=lease), {SHOPPER})


def test_a_save_delayed_past_the_hand_over_is_refused(isolated: Isolated, tmp_path: Path) -> None:
    redis = OwnRedis(tmp_path)
    redis.start()
    proxy = TcpProxy(tmp_path, redis.port)
    with stopping(proxy, redis):
        proxy.start()
        runner = EmbeddedRunner(isolated.runner(until_drained=False), log=lambda _: None)
        now = time.time()
        cart = parse_event(cart_add(SHOPPER, now - 60)[1])
        newer = parse_event(view(SHOPPER, now - 30))

        async def scenario() -> tuple[int, list[TopicPartition], dict[str, object]]:
            via_proxy = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
            direct = aioredis.Redis.from_url(redis.url)
            try:
                # Member A owns the partition and has applied the cart add in an epoch of its lease.
                await owning_with_an_epoch(runner, via_proxy, isolated, cart)
                # Its durable point sends the save into the stalled link, and the revoke gives up.
                proxy.hold()
                durable = asyncio.create_task(runner.commits.durable_point())
                await wait_until(lambda: proxy.unread_bytes() > 0, "A's save sent into the held link", 30)
                assert runner.assignment.end_lease(wait_s=1.0)
                # Member B takes the partition, finds no session (A's save has not landed), replays
                # the cart add and applies a newer view, and saves.
                member_b = EmbeddedRunner(isolated.runner(until_drained=False), log=lambda _: None)
                b_store = member_b.store = RedisSessionStore(direct, isolated.prefix)
                assert await member_b.ownership.ensure([PARTITION], member_b.assignment.lease)
                b_tokens = member_b.ownership.tokens(member_b.assignment.lease)
                assert await b_store.load_many([SHOPPER]) == {}
                b_session = runner.processor.new_session(SHOPPER)
                runner.processor.apply(b_session, cart)
                runner.processor.apply(b_session, newer)
                b_changes = b_session.take_changes()
                await b_store.save([SessionDelta(SHOPPER, PARTITION, b_changes, None)], b_tokens)
                # The link comes back: A's save reaches Redis.
                proxy.release()
                _, offsets = await asyncio.wait_for(durable, timeout=30)
                stored = (await b_store.load_many([SHOPPER]))[SHOPPER]
                return (
                    runner.stats.fenced_saves,
                    offsets,
                    {
                        "arrivals": len(stored.entries),
                        "header": stored.header(),
                        "b_header": b_session.header(),
                    },
                )
            finally:
                proxy.release()
                await via_proxy.aclose()
                await direct.aclose()

        fenced, offsets, stored = asyncio.run(scenario())
    assert stored["arrivals"] == 2, f"A's delayed save landed over B's session: {stored}"
    assert stored["header"] == stored["b_header"]
    assert fenced == 1 and offsets == [], "A's durable point is dropped, nothing to commit"


def test_a_save_refused_while_the_lease_holds_stops_the_runner(isolated: Isolated) -> None:
    """Another member took the partition while this one's lease still holds it (it was dropped from
    the group without a revoke yet, or Redis went back to an older token): the durable point is not
    dropped silently, which would commit nothing from then on and let evicted sessions come back older;
    the runner stops with ``OwnershipLost``, and a restart rejoins and replays."""
    runner = EmbeddedRunner(isolated.runner(until_drained=False), log=lambda _: None)
    cart = parse_event(cart_add(SHOPPER, time.time() - 60)[1])

    async def scenario() -> tuple[str, bytes | None]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        try:
            await owning_with_an_epoch(runner, redis, isolated, cart)
            await RedisSessionStore(redis, isolated.prefix).take_ownership(PARTITION)  # another member
            with pytest.raises(OwnershipLost) as lost:
                await runner.commits.durable_point()
            return str(lost.value), await redis.get(runner.store.keys.session_header(SHOPPER))
        finally:
            await redis.aclose()

    message, stored = asyncio.run(scenario())
    assert f"partitions [{PARTITION}]" in message and stored is None


def test_a_partition_asked_for_as_its_take_completes_is_not_taken_twice(isolated: Isolated) -> None:
    """Ingest's first poll and the re-arm ask for the same partition's token. One that asked just
    after the take finished, before the first asker had kept its token, found neither the token nor a
    take under way and took the partition again: the member's own second token fenced the saves made
    with the first. The token is held by the time the take is done; asked right then, no second take."""
    runner = EmbeddedRunner(isolated.runner(until_drained=False), log=lambda _: None)

    async def scenario() -> tuple[bool, str, bytes | None]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        runner.store = RedisSessionStore(redis, isolated.prefix)
        own = runner.ownership
        try:
            lease = runner.assignment.lease
            first = asyncio.create_task(own.ensure([PARTITION], lease))
            while not own._taking:  # the take under way
                await asyncio.sleep(0)
            take = next(iter(own._taking.values()))
            asked: list[asyncio.Task[bool]] = []
            held_when_done: list[bool] = []

            def the_rearm_asks(_: object) -> None:  # runs as the take is done, before ``first`` resumes
                held_when_done.append(own.holds([PARTITION], lease))
                asked.append(asyncio.ensure_future(own.ensure([PARTITION], lease)))

            take.add_done_callback(the_rearm_asks)
            await first
            assert await asked[0]
            in_redis = await redis.get(runner.store.keys.session_owner(PARTITION))
            return held_when_done[0], own.tokens(lease)[PARTITION], in_redis
        finally:
            await redis.aclose()

    held_when_done, held, in_redis = asyncio.run(scenario())
    assert held_when_done, "the take was done and its token not held yet"
    assert in_redis is not None and in_redis.decode() == held, "the member fenced its own token"
