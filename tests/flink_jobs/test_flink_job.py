"""The Flink job's topology in the local MiniCluster, on a bounded input, against real Redis, a moto S3
server and simulator replicas. One job run is shared by every assertion (start-up costs ~10 s)."""

from __future__ import annotations

import base64
import gzip
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# PyFlink is the 'flink' extra, which `make test` installs: a missing PyFlink fails here, never skips.
import pyflink  # noqa: F401
import pytest
import redis as sync_redis

from devstack.flink_local import moto_s3, sample_events
from devstack.stack import StackState
from flink_jobs.flink_config import AsyncSettings, CheckpointSettings, NearRealtimeSettings
from flink_jobs.near_realtime import BoundedRun, run_bounded
from llm_client.config import ClientConfig, HealthSettings, Timeouts
from prompt_assembly.events import MalformedEvent, parse_event
from serving.simulator.launch import simulator_replicas
from sinks.config import SinkSettings
from tests.helpers import assert_latest_wins, expected_prompts, final_seq_by_shopper

pytestmark = [pytest.mark.flink, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FlinkRun:
    events: list[bytes]
    run: BoundedRun
    settings: NearRealtimeSettings
    s3_records: list[dict[str, object]]
    s3_keys: list[str]
    redis_signals: dict[str, dict[str, str]]


def _events() -> list[bytes]:
    events = sample_events(12, 10, seed=11, malformed=3)
    events.append(b"")  # an empty value, as a Kafka tombstone would be
    return events


@pytest.fixture(scope="module")
def flink_run(tmp_path_factory: pytest.TempPathFactory, stack: StackState) -> Iterator[FlinkRun]:
    """Redis comes from the session's stack (the machine's, a container, or one the stack started)."""
    tag = uuid.uuid4().hex[:10]
    prefix = f"test-flink-{tag}:"
    redis_url = stack.redis_url
    redis = sync_redis.Redis.from_url(redis_url)
    redis.ping()
    monkey = pytest.MonkeyPatch()
    monkey.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkey.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    try:
        with simulator_replicas(2, time_scale=0.01) as urls, moto_s3() as s3_url:
            settings = NearRealtimeSettings(
                prompts_topic=None,  # the whole job in one MiniCluster, its own async stage enriching
                checkpoint=CheckpointSettings(
                    interval_ms=2_000, directory=tmp_path_factory.mktemp("ckpt").as_uri()
                ),
                async_io=AsyncSettings(capacity=64, bundle_time_ms=1_000),
                llm=ClientConfig(
                    endpoints=urls,
                    timeouts=Timeouts(connect_s=2, attempt_s=20, deadline_s=60),
                    health=HealthSettings(interval_s=0.2),
                ),
                sinks=SinkSettings(
                    redis_url=redis_url,
                    redis_key_prefix=prefix,
                    s3_endpoint_url=s3_url,
                    s3_bucket=f"flink-{tag}",
                    s3_prefix=f"test-{tag}",
                ),
            )
            s3 = _s3(settings)
            s3.create_bucket(Bucket=settings.sinks.s3_bucket)
            events = _events()
            run = run_bounded(events, settings)
            keys, records = _read_s3(settings)
            signals = {
                key.decode().removeprefix(f"{prefix}signals:"): {
                    k.decode(): v.decode() for k, v in _hgetall(redis, key).items()
                }
                for key in redis.scan_iter(f"{prefix}signals:*", count=1000)
            }
            yield FlinkRun(events, run, settings, records, keys, signals)
    finally:
        keys = list(redis.scan_iter(f"{prefix}*", count=1000))
        if keys:
            redis.delete(*keys)
        redis.close()
        monkey.undo()


def _hgetall(client: sync_redis.Redis, key: bytes) -> dict[bytes, bytes]:
    return dict(client.hgetall(key))  # type: ignore[arg-type]  # sync client; stubs union in async


def _s3(settings: NearRealtimeSettings) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=settings.sinks.s3_endpoint_url, region_name="us-east-1")


def _read_s3(settings: NearRealtimeSettings) -> tuple[list[str], list[dict[str, object]]]:
    client = _s3(settings)
    keys: list[str] = []
    records: list[dict[str, object]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=settings.sinks.s3_bucket):
        for obj in page.get("Contents", []):
            keys.append(obj["Key"])
            body = client.get_object(Bucket=settings.sinks.s3_bucket, Key=obj["Key"])["Body"].read()
            records += [orjson.loads(line) for line in gzip.decompress(body).splitlines() if line]
    return keys, records


def _valid(events: list[bytes]) -> list[bytes]:
    out = []
    for raw in events:
        try:
            parse_event(raw)
        except MalformedEvent:
            continue
        out.append(raw)
    return out


def test_malformed_records_go_to_the_dlq_with_reason_and_original(flink_run: FlinkRun) -> None:
    dlq = [orjson.loads(r) for r in flink_run.run.dlq]
    assert len(dlq) == len(flink_run.events) - len(_valid(flink_run.events)) == 4
    by_original = {d["original"]: d for d in dlq}
    assert by_original["{not json"]["reason"].startswith("invalid JSON")
    assert by_original["{not json"]["original_encoding"] == "utf-8"
    binary = base64.b64encode(b"\xff\xfe binary").decode()
    assert by_original[binary]["original_encoding"] == "base64"
    assert all(d["reason"] for d in dlq)


def test_every_prompt_has_exactly_one_result_and_matches_the_pure_processor(flink_run: FlinkRun) -> None:
    expected = expected_prompts([(b"", raw, True) for raw in flink_run.events])
    results = [orjson.loads(r) for r in flink_run.run.results]
    ids = [r["request_id"] for r in results]
    assert len(ids) == len(set(ids)), "a prompt produced more than one result"
    assert set(ids) == set(expected)
    for result in results:
        prompt = expected[result["request_id"]]
        assert (result["seq"], result["reason"]) == (prompt.seq, prompt.reason)
        if result["kind"] == "insight":
            assert result["event_count"] == prompt.event_count
    assert all(r["kind"] != "error" for r in results), [r for r in results if r["kind"] == "error"]
    # Latest wins (the default overload policy): some older prompts may be superseded by newer ones.
    signals = {
        shopper: (int(fields["session_epoch"]), int(fields["seq"]))
        for shopper, fields in flink_run.redis_signals.items()
    }
    assert_latest_wins(expected, results, signals)


def test_pending_triggers_flush_at_end_of_input(flink_run: FlinkRun) -> None:
    newest: dict[str, float] = {}
    for raw in _valid(flink_run.events):
        event = parse_event(raw)
        newest[event.shopper_id] = max(newest.get(event.shopper_id, 0.0), event.ts)
    covered: dict[str, float] = {}
    for line in flink_run.run.results:
        result = orjson.loads(line)
        covered[result["shopper_id"]] = max(covered.get(result["shopper_id"], 0.0), result["last_event_ts"])
    assert covered == newest, "some shopper's newest events never reached a prompt"


def test_redis_holds_each_shoppers_newest_signal(flink_run: FlinkRun) -> None:
    expected = expected_prompts([(b"", raw, True) for raw in flink_run.events])
    seqs = {shopper: int(fields["seq"]) for shopper, fields in flink_run.redis_signals.items()}
    assert seqs == final_seq_by_shopper(expected)
    for fields in flink_run.redis_signals.values():
        assert fields["summary"] and fields["request_id"].endswith(":" + fields["seq"])


def test_s3_holds_every_result_once(flink_run: FlinkRun) -> None:
    ids = sorted(str(r["request_id"]) for r in flink_run.s3_records)
    assert ids == sorted(orjson.loads(r)["request_id"] for r in flink_run.run.results)
    assert all(key.startswith(flink_run.settings.sinks.s3_prefix + "/kind=") for key in flink_run.s3_keys)


PYFLINK_WORKER_VARIABLES = frozenset(
    {
        "PYFLINK_GATEWAY_DISABLED",
        "_PYFLINK_CONN_INFO_PATH",
        "PYTHON_LOOPBACK_SERVER_ADDRESS",
        "_PYTHON_WORKER_MEMORY_LIMIT",
    }
)
"""What a MiniCluster run in this process (``flink_run``: its Python workers run here, over the loopback
server) leaves in ``os.environ``. A child that inherits them takes itself for a Python worker and refuses
to start a gateway of its own, which a user's shell never does."""


def test_the_documented_local_run_answers_the_sample_in_a_minicluster(stack: StackState) -> None:
    """``python -m devstack.flink_local`` (README, docs/flink.md): the whole job in one MiniCluster over a
    generated sample, with simulator replicas and a moto S3 of its own. It has no Kafka for a prompts
    topic, so it runs the job's own async stage whatever the default; it once crashed reading the
    default's prompt records as results."""
    prefix = f"test-flink-local-{uuid.uuid4().hex[:8]}:"
    env = {k: v for k, v in os.environ.items() if k not in PYFLINK_WORKER_VARIABLES}
    env |= {"FLINK_JOB_SINKS__REDIS_URL": stack.redis_url, "FLINK_JOB_SINKS__REDIS_KEY_PREFIX": prefix}
    command = [sys.executable, "-m", "devstack.flink_local", "--shoppers", "4", "--events-per-shopper", "6"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        redis = sync_redis.Redis.from_url(stack.redis_url)
        keys = list(redis.scan_iter(f"{prefix}*", count=1000))
        if keys:
            redis.delete(*keys)
        redis.close()
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    landed = re.search(
        r"(\d+) results \((\d+) insights, (\d+) superseded [^,]*, (\d+) errors\), (\d+) to the DLQ",
        done.stdout,
    )
    assert landed is not None, done.stdout[-3000:]
    results, insights, superseded, errors, dead = map(int, landed.groups())
    assert results == insights + superseded and insights > 0, done.stdout[-3000:]
    assert errors == 0 and dead == 3, done.stdout[-3000:]
