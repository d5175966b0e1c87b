"""A stored session the runner cannot read (written by a version it does not know, after a rollback, or
corrupted) no longer stops the stream. Before, the load raised, the runner failed, and every restart
failed at the same shopper. Now what cannot be read is left out (an unreadable header: the shopper
starts over, in a new session epoch), counted and logged, and the shopper's next save rewrites it.
Against the real broker, Redis and simulator replicas."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from prompt_assembly.session import ShopperSession, session_epoch
from runner.embedded import EmbeddedRunner
from runner.session_store import RedisSessionStore
from sinks.keys import RedisKeys
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog
from tests.helpers import produce_records, signal_versions
from tests.runner.kit import cart_add

pytestmark = pytest.mark.slow

LOST_HEADER = "shopper-lost-header"
BAD_ENTRY = "shopper-bad-entry"


def stored(isolated: Isolated) -> dict[str, tuple[ShopperSession, object]]:
    """Each shopper's stored session as a fresh store reads it, with what it could not read."""

    async def load() -> dict[str, tuple[ShopperSession, object]]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        try:
            store = RedisSessionStore(redis, isolated.prefix)
            sessions = await store.load_many([LOST_HEADER, BAD_ENTRY])
            damage = dict(store.take_damaged())
            return {sid: (session, damage.get(sid)) for sid, session in sessions.items()}
        finally:
            await redis.aclose()

    return asyncio.run(load())


def test_an_unreadable_stored_session_is_salvaged_and_the_stream_goes_on(isolated: Isolated) -> None:
    bootstrap = isolated.stack.kafka_bootstrap
    start = time.time() - 600
    first = [cart_add(sid, start + i) for i in range(3) for sid in (LOST_HEADER, BAD_ENTRY)]
    produce_records(bootstrap, isolated.topic, first)
    asyncio.run(EmbeddedRunner(isolated.runner(), log=RunnerLog()).run())
    before = stored(isolated)
    assert {sid: len(session.entries) for sid, (session, _) in before.items()} == {
        LOST_HEADER: 3,
        BAD_ENTRY: 3,
    }
    assert all(damage is None for _, damage in before.values())

    # A header another version wrote (no "seq"), and one log entry whose event no longer reads.
    keys = RedisKeys(isolated.prefix)
    redis = sync_redis.Redis.from_url(isolated.stack.redis_url)
    try:
        redis.set(
            keys.session_header(LOST_HEADER), b'{"shopper_id": "%s", "version": 9}' % LOST_HEADER.encode()
        )
        redis.lset(keys.session_log(BAD_ENTRY), 1, '{"g":0,"n":1,"v":{"event_id":7}}')
    finally:
        redis.close()

    later = start + 120  # past the cart rate limit: each cart add prompts
    second = [cart_add(LOST_HEADER, later), cart_add(BAD_ENTRY, later)]
    produce_records(bootstrap, isolated.topic, second)
    log = RunnerLog()
    runner = EmbeddedRunner(isolated.runner(), log=log)
    stats = asyncio.run(runner.run())

    acct = stats.accounting
    assert acct.consumed == acct.accepted == len(second) and acct.balanced
    assert acct.prompts == 2 == acct.insights + acct.superseded and acct.errors == 0
    assert stats.sessions_salvaged == 2
    assert stats.session_entries_unreadable == 3 + 1  # the lost header's whole log, one entry of the other
    exported = {
        sample.name: sample.value
        for family in text_string_to_metric_families(runner.metrics.exposition().decode())
        for sample in family.samples
    }
    assert exported["shopper_sessions_salvaged_total"] == 2
    (line,) = [line for line in log if line.startswith("session state unreadable")]
    assert "2 shopper(s), 1 started over" in line

    # Each save rewrote what it stored: nothing unreadable is left, the lost header's shopper is a new
    # session (its epoch the new event's), and the other kept every entry it could read.
    after = stored(isolated)
    assert all(damage is None for _, damage in after.values())
    restarted, _ = after[LOST_HEADER]
    assert restarted.epoch == session_epoch(later) and len(restarted.entries) == 1
    kept, _ = after[BAD_ENTRY]
    assert len(kept.entries) == 3 and kept.seq == before[BAD_ENTRY][0].seq + 1
    # Both shoppers' signals landed; the new session's outranks the one its lost state had written.
    versions = signal_versions(isolated.stack.redis_url, isolated.prefix)
    assert set(versions) == {LOST_HEADER, BAD_ENTRY}
