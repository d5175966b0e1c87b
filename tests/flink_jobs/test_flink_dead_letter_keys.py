"""The job keys its dead letters as the embedded runner does: by the original record's Kafka key, as it is.

The same records go to the runner and to the job (the local MiniCluster reading the topic to its end;
with its prompts topic, so nothing calls a model): records keyed by their shopper id, one under a key
that is no shopper id, records sent without a key, a tombstone and a key that is not UTF-8, none of them
a valid event. Both DLQ topics then hold the same records, key and value. Before, the job wrote every
dead letter without a key, so a shopper's dead letters did not share a partition and a reader of the
DLQ could not tell whose they were without parsing the original."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pyflink  # noqa: F401  # the 'flink' extra, which `make test` installs: missing fails, never skips
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from flink_jobs.flink_config import CheckpointSettings, KafkaSettings, NearRealtimeSettings
from flink_jobs.near_realtime import run_kafka
from runner.embedded import EmbeddedRunner
from shopper.readback import read_topic_records
from tests.conftest import Isolated

pytestmark = [pytest.mark.flink, pytest.mark.slow]

RECORDS: list[tuple[bytes | None, bytes | None]] = [
    (b"s-1", b'{"shopper_id": "s-1", "type": "view"'),  # cut short, under its shopper's key
    (b"s-2", b'{"shopper_id": "s-2", "type": "teleport", "ts": 1.0}'),
    (b"another-key", b"not json at all"),  # under a key that is no shopper id
    (None, b'{"type": "view"}'),  # no key, no shopper id
    (None, b"\xff\xfe not UTF-8"),
    (b"s-3", None),  # a tombstone
    (b"\xff\x00 binary key", b"{broken"),  # a key that is not UTF-8
]


def produce_one_batch_each(bootstrap: str, topic: str) -> None:
    """One record per batch: Tansu's ListOffsets(latest) counts batches, and the job's bounded read
    stops at it (``tests/flink_kit.py``)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for key, value in RECORDS:
        producer.produce(topic, key=key, value=value)
        assert producer.flush(30) == 0


def by_key(records: list[tuple[bytes | None, bytes | None]]) -> list[tuple[bytes | None, bytes | None]]:
    return sorted(records, key=lambda record: (record[0] is None, record[0] or b"", record[1] or b""))


def test_the_job_keys_each_dead_letter_by_its_originals_kafka_key_as_the_runner_does(
    isolated: Isolated, tmp_path: Path
) -> None:
    bootstrap = isolated.stack.kafka_bootstrap
    flink_dlq, prompts = f"flink-dlq-{isolated.tag}", f"flink-prompts-{isolated.tag}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(flink_dlq, 1, 1), NewTopic(prompts, 4, 1)]).values():
        future.result(timeout=10)
    produce_one_batch_each(bootstrap, isolated.topic)

    stats = asyncio.run(EmbeddedRunner(isolated.runner(), log=lambda _: None).run())
    assert stats.accounting.dead_lettered == len(RECORDS) and stats.accounting.balanced
    run_kafka(
        NearRealtimeSettings(
            kafka=KafkaSettings(
                bootstrap_servers=bootstrap,
                events_topic=isolated.topic,
                dlq_topic=flink_dlq,
                group_id=f"flink-{isolated.group}",
            ),
            prompts_topic=prompts,
            checkpoint=CheckpointSettings(interval_ms=2_000, directory=(tmp_path / "ckpt").as_uri()),
        ),
        local=True,
        stop_at_latest=True,
    )

    from_runner = by_key(list(read_topic_records(bootstrap, isolated.dlq_topic, expect=len(RECORDS))))
    from_job = by_key(list(read_topic_records(bootstrap, flink_dlq, expect=len(RECORDS))))
    assert [key for key, _ in from_job] == [key for key, _ in by_key(RECORDS)], "keyed by the original's key"
    assert from_job == from_runner, "the engines' dead letters differ, key or value"
    sent = {(key, len(value or b"")) for key, value in RECORDS}
    for key, value in from_job:  # each is the dead letter of the record sent under that key
        letter = orjson.loads(value or b"")
        assert letter["topic"] == isolated.topic and (key, letter["original_size"]) in sent
