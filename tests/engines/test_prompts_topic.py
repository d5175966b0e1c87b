"""The Flink job with ``prompts_topic``, submitted with ``flink run`` to the standalone cluster with its
production timers, hands each prompt to a runner with input 'prompts' (the enrichment as a stage of its
own, docs/flink.md "Prompts topic"): a replayed backlog with malformed records, then a live shopper's
views whose browse pause only the job's wall-clock timer can fire. Every prompt the offline oracle
expects has its one result, stored by the runner in S3 and Redis under latest wins; the job itself
stores none; the prompts topic is keyed by shopper id; the job dead-letters the bad records; every
prompt the runner took is accounted for."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.runner_thread import RunnerThread
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from shopper.readback import read_topic_placed
from tests.conftest import Isolated
from tests.engines.test_engine_agreement import LIVE_VIEWS, records, view, wait_stored, whole_records
from tests.flink_kit import (
    cluster_job_settings,
    drain,
    flink_topics,
    produce,
    read_all,
    run_job,
    wait_committed,
)
from tests.helpers import assert_latest_wins, expected_prompts, signal_versions

pytestmark = [pytest.mark.flink, pytest.mark.slow]


def test_the_flink_job_hands_its_prompts_to_a_prompts_runner(
    isolated: Isolated, stack: StackState, stack_dir: Path, flink_cluster: FlinkClusterState
) -> None:
    stream = SyntheticStream(shoppers=20, seed=17, malformed_rate=0.02).take(300)
    records_in: list[tuple[bytes | None, bytes | None]] = [(k, v) for k, v, _ in stream]
    n_bad = sum(1 for *_, malformed in stream if malformed)
    topics = flink_topics(isolated)
    prompts_topic = f"flink-prompts-{isolated.tag}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    for future in admin.create_topics([NewTopic(prompts_topic, 4, 1)]).values():
        future.result(timeout=10)
    job_prefix, job_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    settings = cluster_job_settings(
        stack, stack_dir, isolated, topics, prefix=job_prefix, s3_prefix=job_s3
    ).model_copy(update={"prompts_topic": prompts_topic})
    assert settings.wall_clock_timers, "the job must run with its production timers"
    enrich = isolated.runner(
        input="prompts", topic=prompts_topic, group_id=f"enrich-{isolated.group}", until_drained=False
    )
    runner = RunnerThread(enrich).start()
    try:
        ends = produce(stack.kafka_bootstrap, isolated.topic, records_in)
        job = run_job(flink_cluster, settings, stack_dir)
        rest = FlinkRest(flink_cluster.web_url)
        wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
        live_at = time.time()
        live: list[tuple[bytes | None, bytes | None]] = [
            (b"s-live", view("s-live", n, live_at + n / 1000)) for n in range(LIVE_VIEWS)
        ]
        produce(stack.kafka_bootstrap, isolated.topic, live)
        expected = expected_prompts([*stream, *((k or b"", v or b"", False) for k, v in live)])
        assert [p.reason for p in expected.values() if p.shopper_id == "s-live"] == ["browse_pause"]
        wait_stored(isolated, f"{isolated.s3_prefix}/", set(expected), runner)  # only timers fire the pauses
        drain(flink_cluster, job.job_id, stack_dir)
    finally:
        stats = runner.stop()

    acct = stats.accounting
    assert acct.balanced and acct.dead_lettered == 0 and acct.errors == 0, acct.as_dict()
    assert acct.prompts == len(expected) == acct.insights + acct.superseded
    stored = whole_records(isolated, f"{isolated.s3_prefix}/")
    assert set(stored) == set(expected)
    assert_latest_wins(expected, stored.values(), signal_versions(stack.redis_url, isolated.prefix))
    assert not records(isolated, f"{job_s3}/"), "the job stored results itself"
    placed = read_topic_placed(stack.kafka_bootstrap, prompts_topic, expect=len(expected))
    assert sorted(str(orjson.loads(value)["request_id"]) for _, _, value in placed) == sorted(expected)
    assert all(key == orjson.loads(value)["shopper_id"].encode() for _, key, value in placed)
    assert len({partition for partition, _, _ in placed}) > 1, "every prompt on one partition"
    assert len(read_all(stack.kafka_bootstrap, topics.dlq, expect=n_bad)) == n_bad
