"""Reading results back: Redis signals, S3 objects and the dead-letter topic.

The Kafka readers take the same ``KafkaSecurity`` as the runner (``RUNNER_KAFKA_SECURITY__*``), so they
reach a broker that needs TLS or SASL. A dead-letter topic is read as bytes: anyone who may produce to
it can put anything there, and ``describe_dead_letter`` makes any record one bounded, escaped line.
"""

from __future__ import annotations

import gzip
import heapq
import time
import uuid
from typing import Any

import boto3
import orjson
import redis.asyncio as aioredis
from confluent_kafka import Consumer, KafkaError, TopicPartition
from rich.text import Text

from pipeline.kafka_security import KafkaSecurity, librdkafka_properties
from pipeline.topic_ends import end_offset
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

READ_TO_END_TIMEOUT_S = 120.0
"""How long ``read_topic_records`` waits for a topic's end (open transactions included)."""


async def read_signals(
    redis_url: str, shopper_ids: list[str], limit: int, prefix: str = "su:"
) -> list[dict[str, str]]:
    """The signals of ``shopper_ids`` (every one found, newest first), or with none given the ``limit``
    most recently written (by ``updated_at``: a ``seq`` starts again at 1 in every new session, so it
    says nothing of when)."""
    schema = RedisKeys(prefix)
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        if shopper_ids:
            limit = len(shopper_ids)  # every id asked for is shown
        else:
            shopper_ids = await _most_recently_written(redis, schema, limit)
        rows = []
        for start in range(0, len(shopper_ids), READ_BATCH):  # one round trip a batch, not a key
            batch = shopper_ids[start : start + READ_BATCH]
            async with redis.pipeline(transaction=False) as pipe:
                for sid in batch:
                    pipe.hgetall(schema.signals(sid))
                found = await pipe.execute()
            rows += [{"shopper_id": sid, **row} for sid, row in zip(batch, found, strict=True) if row]
        rows.sort(key=_newest_first)
        return rows[:limit]
    finally:
        await redis.aclose()


def _newest_first(row: dict[str, str]) -> tuple[float, str]:
    return -_written_at(row.get("updated_at")), row["shopper_id"]


def _written_at(value: str | None) -> float:
    try:
        return float(value or 0)
    except ValueError:  # a hand-written hash: ranked last, still shown when asked for by id
        return 0.0


async def _most_recently_written(redis: aioredis.Redis, schema: RedisKeys, limit: int) -> list[str]:
    """The ids of the ``limit`` signals written last. There is no index by write time, so every key is
    scanned, but only each one's ``updated_at`` is read (pipelined, a batch at a time) and only the best
    ``limit`` are kept: memory is bounded by ``limit`` and the batch, not by the number of shoppers."""
    best: list[dict[str, str]] = []

    async def keep_best(keys: list[str]) -> list[dict[str, str]]:
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "updated_at")
            written = await pipe.execute()
        seen = [
            {"shopper_id": schema.shopper_of_signals(key), "updated_at": at}
            for key, at in zip(keys, written, strict=True)
            if at is not None
        ]
        return heapq.nsmallest(limit, best + seen, key=_newest_first)

    keys: list[str] = []
    async for key in redis.scan_iter(match=schema.signals_pattern(), count=1000):
        keys.append(key)
        if len(keys) == READ_BATCH:
            best, keys = await keep_best(keys), []
    if keys:
        best = await keep_best(keys)
    return [row["shopper_id"] for row in best]


READ_BATCH = 500
"""Signals read in one pipelined round trip."""


def signal_age(row: dict[str, str], now: float) -> str:
    """How old a signal is, as an ad server reading it now sees it: seconds since the newest event it
    reflects (``last_event_ts``), and since it was written (``updated_at``)."""
    return f"{now - float(row['last_event_ts']):,.1f} / {now - float(row['updated_at']):,.1f}"


def list_s3_records(settings: SinkSettings, prefix: str) -> tuple[list[str], list[dict[str, Any]]]:
    """All object keys under ``prefix`` and the records they hold."""
    s3 = boto3.client("s3", **settings.s3_client_kwargs())
    bucket = settings.s3_bucket
    keys: list[str] = []
    records: list[dict[str, Any]] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            keys.append(obj["Key"])
            body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            records.extend(orjson.loads(line) for line in gzip.decompress(body).splitlines() if line)
    return keys, records


def read_dlq(
    bootstrap: str,
    topic: str,
    limit: int | None = None,
    timeout_s: float = 30.0,
    *,
    security: KafkaSecurity | None = None,
) -> list[dict[str, Any]]:
    """Every record of the dead-letter topic (from the beginning) parsed as JSON, newest ``limit`` if
    given; records without a value are left out. Raises on a record that is not JSON: for readers
    that own the topic (tests, the demo); ``shopper tail-dlq`` uses ``read_dlq_values``."""
    values = read_dlq_values(bootstrap, topic, None, timeout_s, security=security)
    records = [orjson.loads(value) for value in values if value is not None]
    return records if limit is None else records[-limit:]


def read_dlq_values(
    bootstrap: str,
    topic: str,
    limit: int | None = None,
    timeout_s: float = 30.0,
    *,
    security: KafkaSecurity | None = None,
) -> list[bytes | None]:
    """Every record value of the dead-letter topic (from the beginning) as it is, ``None`` for a
    record without one; the newest ``limit`` if given."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"dlq-reader-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log.connection.close": False,
            **librdkafka_properties(security or KafkaSecurity()),
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        partitions = [TopicPartition(topic, p, 0) for p in metadata.partitions]
        ends = {tp.partition: end_offset(consumer, tp, timeout_s=10) for tp in partitions}
        consumer.assign(partitions)
        values: list[bytes | None] = []
        done = {p for p, end in ends.items() if end == 0}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ends) and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                offset, partition = message.offset(), message.partition()
                if message.error() or offset is None or partition is None:
                    continue
                values.append(message.value())
                if offset + 1 >= ends[partition]:  # the fetch may know a later end than ListOffsets
                    ends[partition] = end_offset(consumer, TopicPartition(topic, partition))
                if offset + 1 >= ends[partition]:
                    done.add(partition)
        if len(done) < len(ends):
            raise TimeoutError(f"read {len(values)} dead letters but not to the end in {timeout_s} s")
        return values if limit is None else values[-limit:]
    finally:
        consumer.close()


MAX_SHOWN_REASON = 200
MAX_SHOWN_ORIGINAL = 100


def describe_dead_letter(value: bytes | None) -> tuple[str, str]:
    """``(reason, original)`` of a dead-letter record, each one printable line, bounded
    (``MAX_SHOWN_REASON``, ``MAX_SHOWN_ORIGINAL`` characters) and escaped (control, bidi and other
    non-printable characters as ``\\x..``/``\\u....``), so a record can neither flood a terminal nor
    drive it. A record that is not a dead letter this project wrote (not JSON, no ``reason``) is
    described as such, with the start of its bytes."""
    if value is None:
        return "(no value: a tombstone)", ""
    try:
        record = orjson.loads(value)
        kind = "no reason"
    except orjson.JSONDecodeError:
        record, kind = None, "not JSON"
    if isinstance(record, dict) and isinstance(record.get("reason"), str):
        original = _cut(str(record.get("original")), MAX_SHOWN_ORIGINAL)
        return printable(record["reason"], MAX_SHOWN_REASON), repr(original)
    head = value[:MAX_SHOWN_ORIGINAL] + (b"..." if len(value) > MAX_SHOWN_ORIGINAL else b"")
    try:
        shown = repr(head.decode("utf-8"))
    except UnicodeDecodeError:
        shown = repr(head)  # b'...': every byte that is not printable ASCII escaped
    return f"(not a dead letter, {kind}: {len(value)} bytes)", shown


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, each one a terminal cannot act on (ESC, the C1 controls,
    a newline) shown as its escape: stored text comes from producers and the model."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in _cut(text, limit))


MAX_SHOWN_CELL = 240
"""Characters of one stored value shown in a table cell (a summary is at most 240)."""


def cell(value: str) -> Text:
    """A stored value as a table cell: never read as Rich markup (``[/]`` broke the whole table, and
    ``[bold]`` was applied), and printable."""
    return Text(printable(value, MAX_SHOWN_CELL))


def read_topic(bootstrap: str, topic: str, *, expect: int = 0, read_committed: bool = True) -> list[bytes]:
    """Every record value of ``topic`` up to its end (``read_topic_records``)."""
    return [
        value
        for _, value in read_topic_records(bootstrap, topic, expect=expect, read_committed=read_committed)
    ]


def read_topic_records(
    bootstrap: str,
    topic: str,
    *,
    expect: int = 0,
    read_committed: bool = True,
    timeout_s: float = READ_TO_END_TIMEOUT_S,
) -> list[tuple[bytes | None, bytes]]:
    """Every record of ``topic`` as (key, value), read to its end (``read_topic_placed``)."""
    placed = read_topic_placed(
        bootstrap, topic, expect=expect, read_committed=read_committed, timeout_s=timeout_s
    )
    return [(key, value) for _, key, value in placed]


def read_topic_placed(
    bootstrap: str,
    topic: str,
    *,
    expect: int = 0,
    read_committed: bool = True,
    timeout_s: float = READ_TO_END_TIMEOUT_S,
) -> list[tuple[int, bytes | None, bytes]]:
    """Every record of ``topic`` as (partition, key, value), read to the end of each partition as it
    stands when the read gets there, and at least ``expect`` records (a writer may still be finishing); raises
    ``TimeoutError`` naming the partitions not read to their end within ``timeout_s``.

    Why to the end and not "``expect`` records, then a quiet spell": a count can be filled by records
    that are not the ones expected. After a Flink TaskManager was killed, Tansu served the aborted
    transactions' copies to this ``read_committed`` reader, so a reader that stopped at the count
    could stop on those copies before the records it was waiting for. Call it once the writer is done (for
    the Flink job: its group has committed past every input offset and it was drained), and it sees
    every record, duplicates included. With ``read_committed``, a partition's end is reached only
    once its open transactions are over (librdkafka reports the end at the last stable offset): the
    reader waits for them, and an end below the partition's high watermark (``end_offset``) is not the end.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "log.connection.close": False,
        }
    )
    try:
        partitions = [
            TopicPartition(topic, p, 0)
            for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ]
        consumer.assign(partitions)
        values: list[tuple[int, bytes | None, bytes]] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(partitions) or len(values) < expect:
            if time.monotonic() > deadline:
                left = sorted({tp.partition for tp in partitions} - at_end)
                raise TimeoutError(
                    f"{topic}: read {len(values)} records (expected at least {expect}) but partitions "
                    f"{left} not to their end in {timeout_s:.0f} s ({_where_stuck(consumer, topic, left)})"
                )
            message = consumer.poll(0.3)
            if message is None:
                continue
            partition, offset = message.partition(), message.offset()
            error = message.error()
            if error is not None:
                # An end is where this fetch stopped; it is the end once no record lies beyond it.
                if (
                    error.code() == KafkaError._PARTITION_EOF
                    and partition is not None
                    and offset is not None
                    and offset >= end_offset(consumer, TopicPartition(topic, partition))
                ):
                    at_end.add(partition)
                continue
            if partition is None:
                continue
            at_end.discard(partition)
            values.append((partition, message.key(), message.value() or b""))
        return values
    finally:
        consumer.close()


def _where_stuck(consumer: Consumer, topic: str, partitions: list[int]) -> str:
    """Per partition left, how far the read got against the partition's end: with ``read_committed`` a
    position held below the end says a transaction there is still open (never committed or aborted)."""
    stuck = []
    for partition in partitions:
        tp = TopicPartition(topic, partition)
        (position,) = consumer.position([tp])
        end = end_offset(consumer, tp)
        stuck.append(f"partition {partition}: read to offset {position.offset}, end {end}")
    return "; ".join(stuck)
