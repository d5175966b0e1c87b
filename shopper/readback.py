"""Reading results back: Redis signals, S3 objects and the dead-letter topic."""

from __future__ import annotations

import gzip
import time
import uuid
from typing import Any

import boto3
import orjson
import redis.asyncio as aioredis
from confluent_kafka import Consumer, TopicPartition

from pipeline.topic_ends import end_offset
from sinks.config import SinkSettings
from sinks.keys import RedisKeys


async def read_signals(
    redis_url: str, shopper_ids: list[str], limit: int, prefix: str = "su:"
) -> list[dict[str, str]]:
    schema = RedisKeys(prefix)
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        if not shopper_ids:
            keys = [key async for key in redis.scan_iter(match=schema.signals_pattern(), count=1000)]
            shopper_ids = [schema.shopper_of_signals(key) for key in keys]
        rows = []
        for sid in shopper_ids:
            row = await redis.hgetall(schema.signals(sid))
            if row:
                rows.append({"shopper_id": sid, **row})
        rows.sort(key=lambda r: (-int(r["seq"]), r["shopper_id"]))
        return rows[:limit]
    finally:
        await redis.aclose()


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
    bootstrap: str, topic: str, limit: int | None = None, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Every record of the dead-letter topic (from the beginning), newest ``limit`` if given."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"dlq-reader-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log.connection.close": False,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        partitions = [TopicPartition(topic, p, 0) for p in metadata.partitions]
        ends = {tp.partition: end_offset(consumer, tp, timeout_s=10) for tp in partitions}
        consumer.assign(partitions)
        records: list[dict[str, Any]] = []
        done = {p for p, end in ends.items() if end == 0}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ends) and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                value, offset, partition = message.value(), message.offset(), message.partition()
                if message.error() or value is None or offset is None or partition is None:
                    continue
                records.append(orjson.loads(value))
                if offset + 1 >= ends[partition]:  # the fetch may know a later end than ListOffsets
                    ends[partition] = end_offset(consumer, TopicPartition(topic, partition))
                if offset + 1 >= ends[partition]:
                    done.add(partition)
        if len(done) < len(ends):
            raise TimeoutError(f"read {len(records)} dead letters but not to the end in {timeout_s} s")
        return records if limit is None else records[-limit:]
    finally:
        consumer.close()


def read_topic(
    bootstrap: str, topic: str, *, expect: int, read_committed: bool = True, quiet_s: float = 3.0
) -> list[bytes]:
    """Every record value of ``topic``, as a reader of it sees them: until ``expect`` are in and then
    ``quiet_s`` without a new one (so a duplicate would still be seen), at most 120 s."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        values: list[bytes] = []
        deadline = time.monotonic() + 120
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            message = consumer.poll(0.3)
            if message is not None and not message.error():
                values.append(message.value() or b"")
                last_new = time.monotonic()
            elif len(values) >= expect and time.monotonic() - last_new > quiet_s:
                break
        return values
    finally:
        consumer.close()
