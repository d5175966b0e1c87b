"""The two engines agree: the same Kafka records through the job submitted with ``flink run`` to the
standalone Flink cluster (at parallelism 2, a subtask on each of two TaskManagers) and through the
embedded runner give identical Redis signals, S3 records, insights-topic records and dead letters (dead
letters byte for byte, partition, offset and the size limit's cut included; results in every field the
events determine, which leaves out timings and the replica that answered). Stored session entries are
the same bytes too: Flink's keyed state cannot be read from Python, so that is checked on the state
value the job builds (``tests/runner/test_session_store.py``). The records include malformed JSON, an
oversized event, non-UTF-8 bytes and a tombstone; the Flink job keeps running past all of them.

Both engines call the same session processor, client, sinks and dead-letter module; this test guards the
shells and the connector path (Table API Kafka source with metadata columns, KafkaSink). While the job
runs, the compose stack's Flink dashboard is checked against what the cluster's Prometheus reporter
serves."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import redis as sync_redis

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.dead_letter import DeadLetter
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records
from tests.conftest import Isolated
from tests.flink_kit import (
    cluster_job_settings,
    drain,
    flink_topics,
    produce,
    read_all,
    request_ids,
    run_job,
    wait_committed,
)
from tests.helpers import dashboard_metric_names, expected_prompts, prometheus_names

pytestmark = [pytest.mark.flink, pytest.mark.slow]

# Fields that depend only on the events (and the deterministic stand-in model), not on timing or on
# which replica's cache happened to hold the prefix.
FLINK_DASHBOARD = Path(__file__).resolve().parents[2] / "docker/grafana/dashboards/shopper-flink.json"
FLINK_METRIC = re.compile(r"\bflink_[A-Za-z0-9_]+\b")
"""The compose stack's Flink dashboard, checked against the metrics the standalone cluster's Prometheus
reporter serves while the job runs (the runner's dashboard has its own check)."""

SIGNAL_FIELDS = (
    "seq",
    "request_id",
    "summary",
    "interests",
    "occasion",
    "style",
    "price_sensitivity",
    "reason",
    "event_count",
    "last_event_ts",
    "model",
)
DLQ_MAX_ORIGINAL_BYTES = 4_096
"""Both engines' ``dlq_max_original_bytes``: under the oversized record, so both cut it the same way."""
RECORD_FIELDS = (
    "kind",
    "request_id",
    "shopper_id",
    "seq",
    "reason",
    "understanding",
    "event_count",
    "last_event_ts",
    "model",
)


def signals(redis_url: str, prefix: str) -> dict[str, dict[str, str]]:
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return {
            key.removeprefix(f"{prefix}signals:"): {
                f: cast(str | None, client.hget(key, f)) or "" for f in SIGNAL_FIELDS
            }
            for key in client.scan_iter(match=f"{prefix}signals:*", count=1000)
        }
    finally:
        client.close()


def records(isolated: Isolated, s3_prefix: str) -> dict[str, dict[str, Any]]:
    settings = isolated.sinks().model_copy(update={"s3_prefix": s3_prefix})
    _, rows = list_s3_records(settings, s3_prefix)
    return {str(r["request_id"]): {f: r.get(f) for f in RECORD_FIELDS} for r in rows}


def topic_results(bootstrap: str, topic: str, expect: int) -> dict[str, dict[str, Any]]:
    """The insights topic's results by request id, their event-determined fields (as for S3)."""
    rows = [orjson.loads(value) for value in read_all(bootstrap, topic, expect=expect)]
    by_id = {str(r["request_id"]): {f: r.get(f) for f in RECORD_FIELDS} for r in rows}
    assert len(by_id) == len(rows), f"duplicates on {topic}"
    return by_id


def bad_records() -> list[tuple[bytes | None, bytes | None]]:
    """One of each kind the gate must reject, keyed so they land on known shoppers' partitions."""
    oversized = orjson.dumps(
        {"event_id": "big", "shopper_id": "s-big", "type": "search", "ts": 1.0, "query": "x" * 20_000}
    )
    return [
        (b"s-bad-1", b"{not json"),
        (b"s-bad-2", oversized),
        (b"s-bad-3", b"\xff\xfe\x00 not utf-8"),
        (b"s-bad-4", None),  # a tombstone
    ]


def test_flink_cluster_and_embedded_runner_write_the_same_results(
    isolated: Isolated, stack: StackState, stack_dir: Path, flink_cluster: FlinkClusterState
) -> None:
    stream = SyntheticStream(shoppers=20, seed=99, malformed_rate=0.02).take(300)
    records_in: list[tuple[bytes | None, bytes | None]] = [(k, v) for k, v, _ in stream]
    bad = bad_records()
    records_in[100:100] = bad[:2]
    records_in[200:200] = bad[2:]
    expected = expected_prompts([(k or b"", v, True) for k, v in records_in if v is not None])
    ends = produce(stack.kafka_bootstrap, isolated.topic, records_in)

    topics = flink_topics(isolated)
    flink_prefix, flink_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    settings = cluster_job_settings(
        stack, stack_dir, isolated, topics, prefix=flink_prefix, s3_prefix=flink_s3
    ).model_copy(update={"dlq_max_original_bytes": DLQ_MAX_ORIGINAL_BYTES, "parallelism": 2})
    job = run_job(flink_cluster, settings, stack_dir)
    rest = FlinkRest(flink_cluster.web_url)
    wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
    assert rest.job_state(job.job_id) == "RUNNING", "the job stopped on a bad record"
    exported = prometheus_names(flink_cluster.metrics_urls)
    asked = dashboard_metric_names(FLINK_DASHBOARD, FLINK_METRIC)
    assert asked <= exported, (
        f"the Flink dashboard asks for metrics the cluster does not export: {sorted(asked - exported)}; "
        f"exported: {sorted(n for n in exported if 'shopper' in n or 'Checkpoint' in n or 'Restarts' in n)}"
    )
    drain(flink_cluster, job.job_id, stack_dir)

    runner = isolated.runner(dlq_max_original_bytes=DLQ_MAX_ORIGINAL_BYTES)
    stats = asyncio.run(EmbeddedRunner(runner, log=lambda _: None).run())
    assert stats.accounting.balanced and stats.accounting.insights == len(expected)

    embedded_signals = signals(stack.redis_url, isolated.prefix)
    assert len(embedded_signals) == len({p.shopper_id for p in expected.values()})
    assert signals(stack.redis_url, flink_prefix) == embedded_signals

    embedded_records = records(isolated, isolated.s3_prefix)
    assert set(embedded_records) == set(expected)
    assert records(isolated, flink_s3) == embedded_records

    n_dead = stats.accounting.dead_lettered
    embedded_dlq = sorted(read_all(stack.kafka_bootstrap, isolated.dlq_topic, expect=n_dead))
    flink_dlq = sorted(read_all(stack.kafka_bootstrap, topics.dlq, expect=n_dead))
    assert flink_dlq == embedded_dlq, "dead letters differ between the engines"
    letters = [DeadLetter.from_bytes(v) for v in flink_dlq]
    assert len(letters) == n_dead >= len(bad)
    assert any(letter.truncated for letter in letters), "the size limit cut the oversized record"

    embedded_topic = topic_results(stack.kafka_bootstrap, isolated.insights_topic, len(expected))
    assert set(embedded_topic) == set(expected)
    assert topic_results(stack.kafka_bootstrap, topics.insights, len(expected)) == embedded_topic
    assert all(d.reason and d.topic == isolated.topic for d in letters)
    assert all(d.partition is not None and d.offset is not None and d.timestamp_ms for d in letters)
    reasons = " | ".join(d.reason for d in letters)
    assert "invalid JSON" in reasons and "byte limit" in reasons and "null value" in reasons
    assert any(d.original_encoding == "base64" for d in letters)

    insights = read_all(stack.kafka_bootstrap, topics.insights, expect=len(expected))
    assert sorted(request_ids(insights)) == sorted(expected), "insights topic: not one record per prompt"
