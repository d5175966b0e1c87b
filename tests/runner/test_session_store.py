"""The runner's session store against a real Redis: deltas of many epochs, merged per shopper into one
script call, restore exactly the sessions the processor holds (entries in order, header, trims), and
the timer sets follow the pending triggers."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.session import ShopperSession
from runner.session_store import RedisSessionStore, SessionDelta, SessionsFenced, merge_deltas
from tests.fault_kit import TcpProxy
from tests.helpers import until
from tests.runner.kit import view


def _stored_view(session: ShopperSession) -> tuple[list[bytes], dict[str, Any]]:
    return [entry.to_json() for entry in session.entries], session.header()


async def test_many_epochs_merged_per_save_restore_the_same_sessions(redis_client: Any) -> None:
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    owner = {p: await store.take_ownership(p) for p in range(3)}
    # A small event cap makes trims (log rewrites) happen between and within saves.
    processor = SessionProcessor(SessionConfig(max_events=12, trim_to_fraction=0.5))
    sessions: dict[str, ShopperSession] = {}
    records = SyntheticStream(shoppers=25, seed=7).take(1500)
    pending_saves: list[SessionDelta] = []
    try:
        for epoch_start in range(0, len(records), 60):
            touched: set[str] = set()
            for i, (_, value, _) in enumerate(records[epoch_start : epoch_start + 60]):
                event = parse_event(value)
                session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
                processor.apply(session, event, value if i % 2 else None)  # with and without raw JSON
                touched.add(event.shopper_id)
            pending_saves += [SessionDelta(sid, 0, sessions[sid].take_changes(), None) for sid in touched]
            if epoch_start % 180 == 120:  # every third epoch: one save of three epochs' deltas
                await store.save(pending_saves, owner)
                pending_saves = []
        await store.save(pending_saves, owner)
        assert any(session.arrivals > 12 for session in sessions.values()), "trims must have happened"
        loaded = await store.load_many([*sessions, "nobody"])
        assert set(loaded) == set(sessions)
        for sid, session in sessions.items():
            assert _stored_view(loaded[sid]) == _stored_view(session)
            assert loaded[sid].events == session.events
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_timers_follow_pending_triggers(redis_client: Any) -> None:
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    owner = {p: await store.take_ownership(p) for p in range(3)}
    processor = SessionProcessor()
    sessions: dict[str, ShopperSession] = {}
    try:
        for _, value, _ in SyntheticStream(shoppers=6, seed=3).take(40):
            event = parse_event(value)
            session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
            processor.apply(session, event, value)
        armed = {sid: 1000.0 + i for i, sid in enumerate(sessions) if sessions[sid].pending is not None}
        deltas = [SessionDelta(sid, 2, s.take_changes(), armed.get(sid)) for sid, s in sessions.items()]
        await store.save(deltas, owner)
        assert dict(await store.timers(2)) == armed
        cleared = next(iter(armed))
        processor.flush(sessions[cleared])  # the pending trigger fires: no timer any more
        await store.save([SessionDelta(cleared, 2, sessions[cleared].take_changes(), None)], owner)
        assert dict(await store.timers(2)) == {k: v for k, v in armed.items() if k != cleared}
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_a_save_stores_the_timer_of_the_header_it_stores(redis_client: Any) -> None:
    """Epoch 1 left a browse pause pending; the timer fired it in epoch 2, whose prompt is still in
    flight, when epoch 1 alone is made durable. The saved header says pending, so its timer is stored
    with it (the deadline epoch 1 armed): a crash before epoch 2 is durable restores that header, and
    only the stored timer fires it again for a shopper who sends nothing more. Taken from the live
    session (nothing pending by then), the timer was removed. Epoch 2's save then clears it."""
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    owner = {p: await store.take_ownership(p) for p in range(3)}
    processor = SessionProcessor()
    try:
        session = processor.new_session("quiet")
        for _, value, _ in SyntheticStream(shoppers=1, seed=5).take(40):
            processor.apply(session, parse_event(value), value)
            if session.pending is not None and session.pending.reason == "browse_pause":
                break
        assert session.pending is not None and session.pending.reason == "browse_pause"
        epoch_1 = SessionDelta("quiet", 1, session.take_changes(), wall_deadline=1234.5)
        assert processor.fire_pending(session, session.pending.due_ts), "the pause fires a prompt"
        epoch_2 = SessionDelta("quiet", 1, session.take_changes(), wall_deadline=None)
        await store.save([epoch_1], owner)
        assert await store.timers(1) == [("quiet", 1234.5)]
        restored = (await store.load_many(["quiet"]))["quiet"]
        assert restored.pending is not None and restored.pending.reason == "browse_pause"
        await store.save([epoch_2], owner)
        assert await store.timers(1) == []
        assert merge_deltas([epoch_1, epoch_2])["quiet"].wall_deadline is None
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


def test_merged_deltas_keep_the_last_rewrite_and_what_came_after() -> None:
    processor = SessionProcessor(SessionConfig(max_events=4, trim_to_fraction=0.5))
    session = processor.new_session("s")
    deltas: list[SessionDelta] = []
    for _, value, _ in SyntheticStream(shoppers=1, seed=1).take(9):
        processor.apply(session, parse_event(value), value)
        deltas.append(SessionDelta("s", len(deltas) % 3, session.take_changes(), None))
    net = merge_deltas(deltas)["s"]
    assert net.rewrite and net.header == deltas[-1].changes.header and net.partition == deltas[-1].partition
    last_rewrite = max(i for i, d in enumerate(deltas) if d.changes.rewrite is not None)
    expected = list(deltas[last_rewrite].changes.rewrite or [])
    for delta in deltas[last_rewrite + 1 :]:
        expected += delta.changes.appended
    assert [e.to_json() for e in net.entries] == [e.to_json() for e in expected]
    assert [e.to_json() for e in net.entries] == [e.to_json() for e in session.entries]


async def test_the_flink_state_value_holds_the_same_entry_bytes_as_the_runner_store(
    redis_client: Any,
) -> None:
    """Both engines keep a session entry as the same bytes: the runner's Redis log (one list item per
    entry) and the Flink job's keyed state (``ShopperSession.to_json``, what ``ShopperSessionFunction``
    stores), for the same events with their raw JSON, as both engines pass it. Flink's keyed state cannot
    be read from Python, so the state value is checked here, as the function builds it."""
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    owner = {p: await store.take_ownership(p) for p in range(3)}
    processor = SessionProcessor(SessionConfig(max_events=12, trim_to_fraction=0.5))
    runner_sessions: dict[str, ShopperSession] = {}
    flink_state: dict[str, bytes] = {}
    try:
        for _, compact, _ in SyntheticStream(shoppers=8, seed=11).take(300):
            value = json.dumps(orjson.loads(compact)).encode()  # as a producer may send it: spaced
            event = parse_event(value)
            sid = event.shopper_id
            session = runner_sessions.setdefault(sid, processor.new_session(sid))
            processor.apply(session, event, value)
            await store.save([SessionDelta(sid, 0, session.take_changes(), None)], owner)
            in_flink = ShopperSession.from_json(flink_state[sid]) if sid in flink_state else None
            in_flink = in_flink or processor.new_session(sid)
            processor.apply(in_flink, event, value)
            in_flink.take_changes()
            flink_state[sid] = in_flink.to_json()
        for sid, state in flink_state.items():
            stored_log = await redis_client.lrange(store.keys.session_log(sid), 0, -1)
            assert stored_log, sid
            flink_entries = [entry.to_json() for entry in ShopperSession.from_json(state).entries]
            assert b",".join(flink_entries) in state  # stored as is, not re-encoded
            assert sorted(flink_entries) == sorted(stored_log)
            stored_header = await redis_client.get(store.keys.session_header(sid))
            assert orjson.loads(stored_header) == orjson.loads(state)["h"]
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_a_save_with_an_older_owner_token_writes_nothing(redis_client: Any) -> None:
    """Member A took partitions 0 and 1; member B has taken 0 since (a hand-over). A's save touching
    both is refused whole, naming partition 0, and leaves every key as it was; B's own save of the
    same shopper, and A's save of partition 1 alone, go through. A partition without a token is
    refused before anything is sent."""
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    processor = SessionProcessor()
    try:
        a = {0: await store.take_ownership(0), 1: await store.take_ownership(1)}
        b = {0: await store.take_ownership(0)}
        assert b[0] != a[0]
        now = time.time()
        moved, stayed = processor.new_session("moved"), processor.new_session("stayed")
        for session in (moved, stayed):
            for i in range(3):
                processor.apply(session, parse_event(view(session.shopper_id, now - 60 + i)))
        a_deltas = [
            SessionDelta("moved", 0, moved.take_changes(), None),
            SessionDelta("stayed", 1, stayed.take_changes(), None),
        ]
        with pytest.raises(SessionsFenced) as refused:
            await store.save(a_deltas, a)
        assert refused.value.partitions == [0]
        assert await store.load_many(["moved", "stayed"]) == {}
        assert await store.save(a_deltas[1:], a) == 1
        b_session = processor.new_session("moved")
        for i in range(2):
            processor.apply(b_session, parse_event(view("moved", now - 30 + i)))
        assert await store.save([SessionDelta("moved", 0, b_session.take_changes(), None)], b) == 1
        loaded = await store.load_many(["moved", "stayed"])
        assert _stored_view(loaded["moved"]) == _stored_view(b_session)
        assert _stored_view(loaded["stayed"]) == _stored_view(stayed)
        with pytest.raises(SessionsFenced, match="no token"):
            await store.save(
                [SessionDelta("other", 2, processor.new_session("other").take_changes(), None)], b
            )
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_a_token_redis_has_lost_is_restored_by_its_owners_save(redis_client: Any) -> None:
    """Redis restarted without persistence (or a failover lost the key): the owner's next save is not
    refused for ever, which would stop its commits; it sets its token back, and a later owner's take
    still fences it. Tokens are random, so one taken after the loss is never the old owner's."""
    store = RedisSessionStore(redis_client, f"test-store-{uuid.uuid4().hex[:8]}:")
    processor = SessionProcessor()
    try:
        owner = {0: await store.take_ownership(0)}
        await redis_client.delete(store.keys.session_owner(0))
        session = processor.new_session("kept")
        processor.apply(session, parse_event(view("kept", time.time() - 60)))
        assert await store.save([SessionDelta("kept", 0, session.take_changes(), None)], owner) == 1
        assert (await redis_client.get(store.keys.session_owner(0))).decode() == owner[0]
        await store.take_ownership(0)
        processor.apply(session, parse_event(view("kept", time.time() - 50)))
        with pytest.raises(SessionsFenced):
            await store.save([SessionDelta("kept", 0, session.take_changes(), None)], owner)
    finally:
        keys = [key async for key in redis_client.scan_iter(f"{store.keys.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_a_save_tried_again_after_its_reply_was_lost_is_applied_once(
    redis_client: Any, stack: StackState, tmp_path: Path
) -> None:
    """A save sent over a stalled link (a socat proxy held with SIGSTOP) times out at the client
    (``SINK_REDIS_TIMEOUT_S``), lands when the link comes back, and is tried again, as the runner's
    durable point retries it. Its appends ran twice: the log held every entry twice, and a restored
    session listed its events twice. Tried again under the same ``save_id``, it writes nothing."""
    proxy = TcpProxy(tmp_path, urlsplit(stack.redis_url).port or 6379, name="redis-proxy")
    proxy.start()
    prefix = f"test-store-{uuid.uuid4().hex[:8]}:"
    via_proxy = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5)
    store = RedisSessionStore(via_proxy, prefix)
    processor = SessionProcessor()
    try:
        tokens = {0: await store.take_ownership(0)}
        session = processor.new_session("retried")
        for i in range(3):
            processor.apply(session, parse_event(view("retried", time.time() - 60 + i)))
        deltas = [SessionDelta("retried", 0, session.take_changes(), None)]
        proxy.hold()
        with pytest.raises(RedisTimeoutError):
            await store.save(deltas, tokens, "save-1")
        proxy.release()
        direct = RedisSessionStore(redis_client, prefix)
        await until(lambda: _has_session(direct, "retried"))  # the first try lands
        assert await store.save(deltas, tokens, "save-1") == 1  # the retry
        loaded = (await direct.load_many(["retried"]))["retried"]
        assert _stored_view(loaded) == _stored_view(session)
        assert len(loaded.entries) == 3
    finally:
        proxy.stop()
        await via_proxy.aclose()
        keys = [key async for key in redis_client.scan_iter(f"{prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def _has_session(store: RedisSessionStore, shopper_id: str) -> bool:
    return shopper_id in await store.load_many([shopper_id])
