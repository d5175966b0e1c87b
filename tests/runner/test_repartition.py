"""Events a producer sent unkeyed or keyed by something else are re-keyed by shopper id before any
session sees them, through the runner's own repartition topic.

The runner owns sessions by partition. Tried as a new user would, with a plain producer: an unkeyed
event lands on a random partition, a mis-keyed one on its key's, so with two runners in the group a
shopper had a session on each, each saving its own header over the other's. Now a record whose key
is not its shopper id is produced to the repartition topic keyed by it (its original committed only
once the copy is acknowledged), counted as ``rekeyed``, and the copy is applied by the member that owns
the shopper's partition. The copies go to a topic of their own: the event topic holds only what the
producers sent, so its other consumers never read an event twice. Two runners, four partitions, the
real broker and Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest
import redis.asyncio as aioredis
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.processes import free_port
from prompt_assembly.events import parse_event
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.errors import RekeyUndelivered
from runner.repartition import REKEYED_FROM, TOPIC_NAME, Repartitioner, header_names
from runner.session_store import RedisSessionStore
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, wait_until
from tests.runner.kit import view

pytestmark = pytest.mark.slow

PARTITIONS = 4
SHOPPERS = 8
KEYED_PER_SHOPPER = 4
"""Each shopper's correctly keyed events; it also sends one unkeyed and one mis-keyed."""
VIEW_GAP_S = 5
"""Event time between a shopper's views: inside the quiet period, so no prompt (the test is about
where events go, not what the LLM answers)."""


def shopper_records(sid: str, start: float) -> list[tuple[bytes | None, bytes]]:
    """(key, value) in the order sent: keyed, unkeyed, keyed, mis-keyed (a session id), keyed..."""
    keys: list[bytes | None] = [sid.encode(), None, sid.encode(), f"session-{uuid.uuid4().hex}".encode()]
    keys += [sid.encode()] * (KEYED_PER_SHOPPER - 2)
    return [(key, view(sid, start + i * VIEW_GAP_S)) for i, key in enumerate(keys)]


Placed = list[tuple[bytes | None, int, list[str], int]]
"""(key, partition, header names, offset) of each record of a topic."""


def placed_records(bootstrap: str, topic: str, expect: int) -> Placed:
    """Every record on the topic (at least ``expect``, read to each partition's end, which a watermark
    cannot tell on Tansu: its ListOffsets counts batches): key, partition, headers' names and offset."""
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    found: Placed = []
    at_end: set[int] = set()
    try:
        reader.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 60
        while len(at_end) < PARTITIONS or len(found) < expect:
            assert time.monotonic() < deadline, f"{topic}: read {len(found)}, partitions at end {at_end}"
            message = reader.poll(0.5)
            if message is None:
                continue
            partition, error = message.partition(), message.error()
            assert partition is not None
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    at_end.add(partition)
                continue
            at_end.discard(partition)
            found.append((message.key(), partition, header_names(message), message.offset() or 0))
    finally:
        reader.close()
    return found


def partitions_by_key(placed: Placed) -> dict[bytes | None, set[int]]:
    """Every key, and the partitions holding records with it."""
    found: dict[bytes | None, set[int]] = {}
    for key, partition, *_ in placed:
        found.setdefault(key, set()).add(partition)
    return found


def test_unkeyed_and_mis_keyed_events_reach_their_shoppers_one_session(isolated: Isolated) -> None:
    bootstrap = isolated.stack.kafka_bootstrap
    logs = [RunnerLog(), RunnerLog()]
    settings = isolated.runner(until_drained=False)
    runners = [EmbeddedRunner(settings, log=log) for log in logs]
    start = time.time() - 600
    sent = {f"shopper-{i:02d}": shopper_records(f"shopper-{i:02d}", start) for i in range(SHOPPERS)}
    events = sum(len(records) for records in sent.values())
    misplaced = sum(key != sid.encode() for sid, records in sent.items() for key, _ in records)

    async def scenario() -> None:
        tasks = [asyncio.create_task(runner.run()) for runner in runners]
        try:
            await wait_until(
                lambda: all(len(r.assigned_partitions()) == PARTITIONS // 2 for r in runners), "two members"
            )
            producer = Producer({"bootstrap.servers": bootstrap})  # a plain producer, its defaults
            for step in range(KEYED_PER_SHOPPER + 2):  # the shoppers' events interleaved, in order each
                for records in sent.values():
                    key, value = records[step]
                    producer.produce(isolated.topic, key=key, value=value)
            assert await asyncio.to_thread(producer.flush, 30) == 0
            accts = [r.stats.accounting for r in runners]
            await wait_until(
                lambda: sum(a.accepted for a in accts) == events and not any(r.epochs for r in runners),
                "every event applied and made durable",
            )
        finally:
            for runner in runners:
                runner.request_stop()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
    except BaseException:
        for i, log in enumerate(logs):
            print(f"---- runner {i} ----\n{log.render()}", flush=True)
        raise

    async def stored() -> dict[str, tuple[int, list[str]]]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        try:
            sessions = await RedisSessionStore(redis, isolated.prefix).load_many(list(sent))
            return {
                sid: (s.arrivals, sorted(e.event.event_id for e in s.entries)) for sid, s in sessions.items()
            }
        finally:
            await redis.aclose()

    sessions = asyncio.run(stored())
    for sid, records in sent.items():
        want = (len(records), sorted(orjson.loads(value)["event_id"] for _, value in records))
        assert sessions.get(sid) == want, f"{sid}: not one session holding all its events"
    accts = [r.stats.accounting for r in runners]
    assert sum(a.rekeyed for a in accts) == misplaced
    assert sum(a.consumed for a in accts) == events + misplaced, "each copy consumed once"
    assert sum(a.duplicates for a in accts) == 0
    assert sum(a.prompts for a in accts) == 0
    assert all(a.balanced for a in accts), accts
    exposition = b"".join(r.metrics.exposition() for r in runners).decode()
    assert f"shopper_events_rekeyed_total {float(accts[0].rekeyed)}" in exposition

    on_events = placed_records(bootstrap, isolated.topic, events)
    assert len(on_events) == events, "the event topic holds copies: its other consumers read them twice"
    placed = partitions_by_key(on_events)
    assert all(len(placed[sid.encode()]) == 1 for sid in sent), "a shopper's keyed records on two partitions"
    copies = placed_records(bootstrap, settings.repartition_topic_name, misplaced)
    assert len(copies) == misplaced
    assert all(REKEYED_FROM in names for _, _, names, _ in copies), "a copy that does not name its original"
    assert partitions_by_key(copies) == {key: placed[key] for key in {key for key, *_ in copies}}, (
        "a copy on another partition number than its shopper's keyed records"
    )
    # A poll holds partition p of both topics; each topic's offset is committed (they were once kept by
    # partition number alone, so the topic read first in a poll was left behind).
    for topic, read_back in ((isolated.topic, on_events), (settings.repartition_topic_name, copies)):
        assert committed_offsets(bootstrap, isolated.group, topic) == next_offsets(read_back), topic


def next_offsets(placed: Placed) -> dict[int, int]:
    """Per partition, the offset after its last record (0 for an empty one)."""
    ends = dict.fromkeys(range(PARTITIONS), 0)
    for _, partition, _, offset in placed:
        ends[partition] = max(ends[partition], offset + 1)
    return ends


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition; a partition with nothing on it counts as 0."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        return {tp.partition: max(tp.offset, 0) for tp in tps}
    finally:
        consumer.close()


def test_a_group_id_a_topic_name_cannot_hold_still_names_a_repartition_topic_of_its_own() -> None:
    """Kafka takes any characters in a group id but only letters, digits, '.', '_' and '-' in a topic
    name; the demo's group id holds the stack's ':'."""
    groups = ("demo-stack-1:demo-2:", "demo-stack-1;demo-2;", "plain-group")
    names = {RunnerSettings(group_id=group).repartition_topic_name for group in groups}
    assert len(names) == len(groups) and all(TOPIC_NAME.fullmatch(name) for name in names), names
    plain = RunnerSettings(group_id="plain-group", topic="shopper-events").repartition_topic_name
    assert plain == "shopper-events.plain-group.repartition"


async def test_a_mis_keyed_event_with_a_megabyte_of_headers_is_re_keyed_and_applied(
    isolated: Isolated,
) -> None:
    """The gate bounds a record's value, not its headers. The copy carried the original's headers plus
    its own, so a mis-keyed event with 1 MB of them made a copy the producer refused (message too large):
    the runner stopped, and stopped again on the same record at every restart. The copy now carries only
    its own header; the event is applied and everything is accounted for."""
    producer = Producer({"bootstrap.servers": isolated.stack.kafka_bootstrap, "message.max.bytes": 1_100_000})
    start = time.time()
    producer.produce(
        isolated.topic,
        key=b"not-the-shopper",
        value=view("heavy-headers", start),
        headers=[("trace", b"x" * 1_000_000)],
    )
    for i in range(3):
        producer.produce(isolated.topic, key=b"light", value=view(f"light-{i}", start + i))
    assert producer.flush(30) == 0
    runner = EmbeddedRunner(isolated.runner(), log=RunnerLog())
    stats = await asyncio.wait_for(runner.run(), 120)
    acct = stats.accounting
    assert acct.rekeyed == 4 and acct.accepted == 4 and acct.balanced, acct
    assert stats.commits > 0


def read_messages(bootstrap: str, topic: str, expect: int) -> list[Message]:
    """The first ``expect`` records of ``topic`` (all its partitions), as consumed."""
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    found: list[Message] = []
    try:
        reader.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 30
        while len(found) < expect:
            assert time.monotonic() < deadline, f"{topic}: read {len(found)} of {expect}"
            message = reader.poll(0.5)
            if message is not None and message.error() is None:
                found.append(message)
    finally:
        reader.close()
    return found


def origin(message: Message) -> str:
    return f"{message.topic()}:{message.partition()}:{message.offset()}"


def named_original(copy: Message) -> str:
    """The ``topic:partition:offset`` a copy's ``REKEYED_FROM`` header names."""
    value = dict(copy.headers() or []).get(REKEYED_FROM)
    assert isinstance(value, bytes), copy.headers()
    return value.decode()


async def test_each_re_keyed_copy_carries_its_originals_kafka_timestamp(isolated: Isolated) -> None:
    """Unkeyed events sent with Kafka timestamps of their own (an hour apart, years ago): each copy
    read back from the repartition topic has the timestamp of the original its header names, so the
    event-time gate answers the copy as it would have answered the original."""
    bootstrap = isolated.stack.kafka_bootstrap
    producer = Producer({"bootstrap.servers": bootstrap})
    base_ms = 1_600_000_000_000
    for i in range(4):
        ts_ms = base_ms + i * 3_600_000 + i
        producer.produce(isolated.topic, value=view(f"stamped-{i}", ts_ms / 1000), timestamp=ts_ms)
    assert producer.flush(30) == 0
    originals = read_messages(bootstrap, isolated.topic, 4)
    target = f"{isolated.topic}.stamps.repartition"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(target, PARTITIONS, 1)])[target].result(timeout=10)
    lines: list[str] = []
    rekey = Repartitioner(
        Producer({"bootstrap.servers": bootstrap}), target, lines.append, deliver_max_wait_s=30
    )
    for message in originals:
        await rekey.send(message, parse_event(message.value()))
    await rekey.deliver()
    assert not lines
    stamps = {origin(m): m.timestamp() for m in originals}
    assert sorted(ts for _, ts in stamps.values()) == [base_ms + i * 3_600_000 + i for i in range(4)]
    copies = read_messages(bootstrap, target, 4)
    named = {named_original(c): c.timestamp() for c in copies}
    assert named == stamps, "a copy whose Kafka timestamp is not its original's"


async def test_a_copy_the_broker_refuses_makes_deliver_raise(isolated: Isolated) -> None:
    """The repartition topic does not exist and the producer asks the broker not to create it
    (``allow.auto.create.topics`` off): the real broker answers UNKNOWN_TOPIC_OR_PART in the copy's
    delivery report. The producer's queue is empty then, so only the failure count says the copy is
    lost: ``deliver`` must raise ``RekeyUndelivered`` (nothing past the original may be committed), and
    the next durable point starts counting afresh."""
    bootstrap = isolated.stack.kafka_bootstrap
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(isolated.topic, key=b"not-the-shopper", value=view("refused-copy", time.time()))
    assert producer.flush(30) == 0
    (original,) = read_messages(bootstrap, isolated.topic, 1)
    lines: list[str] = []
    rekey = Repartitioner(
        Producer(
            {
                "bootstrap.servers": bootstrap,
                "allow.auto.create.topics": False,
                "topic.metadata.propagation.max.ms": 1000,
            }
        ),
        f"{isolated.topic}.never-created",
        lines.append,
        deliver_max_wait_s=30,
    )
    await rekey.send(original, parse_event(original.value()))
    with pytest.raises(RekeyUndelivered, match="1 re-keyed event"):
        await rekey.deliver(poll_s=10)
    assert len(lines) == 1 and "NOT delivered" in lines[0] and "Unknown topic" in lines[0], lines
    await rekey.deliver(poll_s=1)  # counted once: the next durable point has nothing to refuse


async def test_a_copy_waiting_for_room_in_a_full_queue_gives_up_when_the_runner_fails(
    isolated: Isolated,
) -> None:
    """The repartition topic's leader is away (here: no broker answers the producer at all) and the
    producer's local queue is full: a copy waits for room. It waited on whatever happened, so once the
    runner had failed (its durable point gave up on the copies queued before) the ingest stayed in that
    wait until librdkafka expired the queue (``message.timeout.ms``, 300 s), and the runner's exit with
    it. It raises the runner's failure now."""
    bootstrap = isolated.stack.kafka_bootstrap
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(2):
        producer.produce(isolated.topic, key=b"not-the-shopper", value=view(f"queued-{i}", time.time()))
    assert producer.flush(30) == 0
    originals = read_messages(bootstrap, isolated.topic, 2)
    failed: list[BaseException] = []
    away = Producer(
        {"bootstrap.servers": f"127.0.0.1:{free_port()}", "queue.buffering.max.messages": 1}
    )  # nobody listens there: nothing is delivered, the queue stays full
    rekey = Repartitioner(
        away, f"{isolated.topic}.away", lambda _: None, deliver_max_wait_s=30,
        failure=lambda: failed[0] if failed else None,
    )  # fmt: skip
    await rekey.send(originals[0], parse_event(originals[0].value()))  # the queue's one place
    waiting = asyncio.create_task(rekey.send(originals[1], parse_event(originals[1].value())))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "the second copy waits for room"
    failed.append(RekeyUndelivered("1 re-keyed event NOT delivered"))
    with pytest.raises(RekeyUndelivered):
        await asyncio.wait_for(waiting, timeout=10)
    away.purge()
    away.close()  # closed, not collected: until a full collection it dialled the port nobody listens on
    producer.close()
