"""The two engine shells agree: the same events through the PyFlink job (MiniCluster, bounded source)
and through the embedded runner (Kafka consumer group) give identical Redis signals and S3 records.
Both call the same session processor, client and sinks; this test guards the shells themselves."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis as sync_redis

from devstack.synthetic import SyntheticStream
from flink_jobs.flink_config import AsyncSettings, CheckpointSettings, NearRealtimeSettings
from flink_jobs.near_realtime import run_bounded
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records
from tests.conftest import Isolated
from tests.helpers import expected_prompts, produce_records

pytestmark = [pytest.mark.flink, pytest.mark.slow]

# Fields that depend only on the events (and the deterministic stand-in model), not on timing or on
# which replica's cache happened to hold the prefix.
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
            key.removeprefix(f"{prefix}signals:"): {f: client.hget(key, f) or "" for f in SIGNAL_FIELDS}
            for key in client.scan_iter(match=f"{prefix}signals:*", count=1000)
        }
    finally:
        client.close()


def records(isolated: Isolated, s3_prefix: str) -> dict[str, dict[str, Any]]:
    settings = isolated.sinks().model_copy(update={"s3_prefix": s3_prefix})
    _, rows = list_s3_records(settings, s3_prefix)
    return {str(r["request_id"]): {f: r.get(f) for f in RECORD_FIELDS} for r in rows}


def test_flink_and_embedded_runner_write_the_same_results(isolated: Isolated) -> None:
    stream = SyntheticStream(shoppers=25, seed=99, malformed_rate=0.02).take(500)
    events = [value for _, value, _ in stream]
    expected = expected_prompts(stream)

    flink_prefix, flink_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    flink = NearRealtimeSettings(
        checkpoint=CheckpointSettings(interval_ms=2_000),
        async_io=AsyncSettings(capacity=64, bundle_time_ms=1_000),
        llm=isolated.llm(),
        sinks=isolated.sinks().model_copy(update={"redis_key_prefix": flink_prefix, "s3_prefix": flink_s3}),
    )
    run_bounded(events, flink)

    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, stream)
    stats = asyncio.run(EmbeddedRunner(isolated.runner(), log=lambda _: None).run())
    assert stats.accounting.balanced and stats.accounting.insights == len(expected)

    embedded_signals = signals(isolated.stack.redis_url, isolated.prefix)
    flink_signals = signals(isolated.stack.redis_url, flink_prefix)
    assert len(embedded_signals) == len({p.shopper_id for p in expected.values()})
    assert flink_signals == embedded_signals

    embedded_records = records(isolated, isolated.s3_prefix)
    assert set(embedded_records) == set(expected)
    assert records(isolated, flink_s3) == embedded_records
