"""A shopper's session is never replaced by a blank one while its batch loads.

``Ingest`` finds which of a poll's shoppers are not in memory and awaits ``store.load_many``. During
that await the committer's durable point evicts idle sessions; it used to evict a shopper of the
batch being processed (in memory, idle, not yet in an epoch), and the batch then started that shopper
at seq 0: the new header overwrote the stored one, and the next prompts reused old ``request_id`` s.
The load here is held (``HeldLoads``, the real store otherwise) until a durable point has evicted, so
the interleaving happens every run instead of now and then; everything else is the real broker and
Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import orjson
import redis.asyncio as aioredis
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.session import ShopperSession
from runner.embedded import EmbeddedRunner
from runner.session_store import RedisSessionStore
from runner.sessions import SessionCache
from tests.conftest import Isolated
from tests.helpers import produce_records
from tests.runner.kit import cart_add, running

CACHE = 100
"""The smallest ``session_cache_size`` the settings allow."""
RETURNING = "shopper-returning"
"""The shopper whose session the held load must not lose."""
NEWCOMER = "shopper-newcomer"
"""A shopper not in memory, so that the second poll has something to load."""


class HeldLoads(RedisSessionStore):
    """The real session store; the load that asks for ``NEWCOMER`` waits for ``release``."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        super().__init__(redis, prefix)
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def load_many(self, shopper_ids: Sequence[str]) -> dict[str, ShopperSession]:
        if NEWCOMER in shopper_ids:
            self.held.set()
            await self.release.wait()
        return await super().load_many(shopper_ids)


def test_a_durable_point_during_a_session_load_keeps_the_batchs_sessions(isolated: Isolated) -> None:
    """The first poll brings the returning shopper and enough others to put the cache over its bound;
    the second brings the returning shopper again and a newcomer, whose load is held until a durable
    point has made the first poll durable and evicted. The returning shopper's stored session must be
    the one the pure processor builds from both of its events."""
    topic = f"{isolated.topic}-one"  # one partition: the two polls come in the order produced
    admin = AdminClient({"bootstrap.servers": isolated.stack.kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=10)
    now = time.time() - 120
    first = [cart_add(RETURNING, now)] + [cart_add(f"shopper-{i:04d}", now) for i in range(CACHE + 20)]
    second = [cart_add(RETURNING, now + 60), cart_add(NEWCOMER, now + 60)]
    produce_records(isolated.stack.kafka_bootstrap, topic, first + second)
    settings = isolated.runner(topic=topic, session_cache_size=CACHE, batch_max_events=len(first))
    runner = EmbeddedRunner(settings, log=lambda _: None, session_store=HeldLoads)

    async def scenario() -> None:
        async with running(runner) as (task,):
            while not isinstance(getattr(runner, "store", None), HeldLoads):
                await asyncio.sleep(0.01)
            store = runner.store
            assert isinstance(store, HeldLoads)
            await asyncio.wait_for(store.held.wait(), 60)
            deadline = time.monotonic() + 60
            # The first poll's epoch taken, made durable, and the cache brought to its bound after it.
            while len(runner.epochs) or runner.commits.busy or not runner.stats.commits:
                assert not task.done(), "the runner ended early"
                assert time.monotonic() < deadline, "no durable point while the load was held"
                await asyncio.sleep(0.02)
            store.release.set()
            await asyncio.wait_for(task, 120)

    try:
        asyncio.run(scenario())
        assert runner.stats.accounting.balanced

        async def stored() -> ShopperSession:
            redis = aioredis.Redis.from_url(isolated.stack.redis_url)
            try:
                return (await RedisSessionStore(redis, isolated.prefix).load_many([RETURNING]))[RETURNING]
            finally:
                await redis.aclose()

        session = asyncio.run(stored())
    finally:
        admin.delete_topics([topic])[topic].result(timeout=10)

    processor = SessionProcessor(settings.session)
    expected = processor.new_session(RETURNING)
    for _, value, _ in (first[0], second[0]):
        processor.apply(expected, parse_event(value))
    got = {k: session.header()[k] for k in ("seq", "epoch", "arrivals")}
    want = {k: expected.header()[k] for k in ("seq", "epoch", "arrivals")}
    assert got == want, "the returning shopper's session was restarted blank"
    assert [e.event.event_id for e in session.entries] == [
        orjson.loads(value)["event_id"] for _, value, _ in (first[0], second[0])
    ]


def test_eviction_goes_by_last_use_not_by_first_load() -> None:
    """A shopper active all along is the last to go, however early it was first loaded."""
    processor = SessionProcessor()
    cache = SessionCache(CACHE)
    sids = [f"shopper-{i:04d}" for i in range(CACHE + 10)]
    for sid in sids:
        cache.use(sid, 0, processor.new_session)
    cache.use(sids[0], 0, processor.new_session)  # the earliest loaded, used again just now

    assert cache.evict(busy=set()) == 10
    assert sids[0] in cache, "the most recently used session was evicted"
    assert set(cache) == {sids[0], *sids[11:]}, "not the least recently used ones went"
