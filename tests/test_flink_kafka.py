"""The real Kafka path (official KafkaSource/KafkaSink from the connector jar) in the MiniCluster.

Runs only when both the connector jar (scripts/fetch-flink-connectors) and a Kafka broker
($FLINK_TEST_KAFKA_BOOTSTRAP, default 127.0.0.1:9092) are available; otherwise it is skipped and says
which one is missing. Everything else about the job is covered by tests/test_flink_job.py."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import orjson
import pytest

pytest.importorskip("pyflink", reason="PyFlink is the 'flink' extra: pip install -e '.[flink]'")

from flink_jobs.flink_connectors import find_kafka_connector_jars

pytestmark = [pytest.mark.flink, pytest.mark.slow]

BOOTSTRAP = os.environ.get("FLINK_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def _broker_problem() -> str | None:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": BOOTSTRAP, "socket.timeout.ms": 3000}).list_topics(timeout=3)
    except Exception as exc:
        return f"no Kafka broker at {BOOTSTRAP} ({exc}); set FLINK_TEST_KAFKA_BOOTSTRAP"
    return None


def test_kafka_source_to_dlq_and_sinks(tmp_path: Path) -> None:
    if not find_kafka_connector_jars():
        pytest.skip("the Flink Kafka connector jar is missing: run scripts/fetch-flink-connectors")
    problem = _broker_problem()
    if problem:
        pytest.skip(problem)

    import boto3
    import redis as sync_redis
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from devstack.flink_local import moto_s3, sample_events, simulator_replicas
    from flink_jobs.flink_config import CheckpointSettings, KafkaSettings, NearRealtimeSettings
    from flink_jobs.near_realtime import run_kafka
    from llm_client.config import ClientConfig
    from sinks.config import SinkSettings

    tag = uuid.uuid4().hex[:8]
    topics = {"events": f"events-{tag}", "dlq": f"dlq-{tag}", "insights": f"insights-{tag}"}
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    for future in admin.create_topics([NewTopic(t, 2, 1) for t in topics.values()]).values():
        future.result(timeout=10)
    events = sample_events(6, 8, seed=3, malformed=2)
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    for raw in events:
        producer.produce(topics["events"], value=raw)
    assert producer.flush(30) == 0

    prefix = f"test-flink-kafka-{tag}:"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    redis = sync_redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        with simulator_replicas(2) as urls, moto_s3() as s3_url:
            settings = NearRealtimeSettings(
                kafka=KafkaSettings(
                    bootstrap_servers=BOOTSTRAP,
                    events_topic=topics["events"],
                    dlq_topic=topics["dlq"],
                    insights_topic=topics["insights"],
                    group_id=f"group-{tag}",
                    transactional_id_prefix=f"tx-{tag}",
                ),
                checkpoint=CheckpointSettings(interval_ms=2000, directory=tmp_path.as_uri()),
                llm=ClientConfig(endpoints=urls),
                sinks=SinkSettings(redis_key_prefix=prefix, s3_endpoint_url=s3_url, s3_bucket=f"k-{tag}"),
            )
            boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(Bucket=f"k-{tag}")
            run_kafka(settings, local=True, stop_at_latest=True)
        consumer = Consumer(
            {
                "bootstrap.servers": BOOTSTRAP,
                "group.id": f"check-{tag}",
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
            }
        )
        consumer.subscribe([topics["dlq"]])
        dlq = []
        for _ in range(30):
            message = consumer.poll(1.0)
            if message is not None and not message.error() and message.value() is not None:
                dlq.append(orjson.loads(message.value() or b"null"))
            if len(dlq) >= 2:
                break
        consumer.close()
        assert len(dlq) == 2 and all(d["reason"] and d["topic"] == topics["events"] for d in dlq)
        assert len(list(redis.scan_iter(f"{prefix}signals:*"))) == 6
    finally:
        keys = list(redis.scan_iter(f"{prefix}*"))
        if keys:
            redis.delete(*keys)
        admin.delete_topics(list(topics.values()))
