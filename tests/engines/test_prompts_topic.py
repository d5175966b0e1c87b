"""The Flink job at its defaults (``prompts_topic`` on), submitted with ``flink run`` to the standalone
cluster with its production timers, hands each prompt to the enrichment runner ``shopper flink submit``
starts beside it (settings derived from the job's, ``devstack.enrichment_stage``; docs/flink.md
"Prompts topic"): a replayed backlog with malformed records, then a live shopper's views whose browse
pause only the job's wall-clock timer can fire. Every prompt the offline oracle expects has its one
result, stored by the runner in S3 and Redis under latest wins, where the job's settings say; the job
has no enrichment stage of its own; the prompts topic is keyed by shopper id; the job dead-letters the
bad records; every prompt the runner took is accounted for."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from shopper.readback import read_topic_placed
from tests.conftest import Isolated
from tests.engines.test_engine_agreement import LIVE_VIEWS, view, wait_stored, whole_records
from tests.flink_kit import (
    cluster_job_settings,
    drain,
    enrichment_runner,
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
    job_prefix, job_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    settings = cluster_job_settings(stack, stack_dir, isolated, topics, prefix=job_prefix, s3_prefix=job_s3)
    assert settings.wall_clock_timers, "the job must run with its production timers"
    assert settings.prompts_topic == topics.prompts, "the default: the job hands its prompts to a topic"
    with enrichment_runner(isolated, settings) as enrich:
        ends = produce(stack.kafka_bootstrap, isolated.topic, records_in)
        job = run_job(flink_cluster, settings, stack_dir)
        rest = FlinkRest(flink_cluster.web_url)
        vertices = " | ".join(v["name"] for v in rest.get(f"/jobs/{job.job_id}")["vertices"])
        assert "shopper sessions" in vertices and "enrich" not in vertices, vertices
        wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
        live_at = time.time()
        live: list[tuple[bytes | None, bytes | None]] = [
            (b"s-live", view("s-live", n, live_at + n / 1000)) for n in range(LIVE_VIEWS)
        ]
        produce(stack.kafka_bootstrap, isolated.topic, live)
        expected = expected_prompts([*stream, *((k or b"", v or b"", False) for k, v in live)])
        assert [p.reason for p in expected.values() if p.shopper_id == "s-live"] == ["browse_pause"]
        wait_stored(isolated, f"{job_s3}/", set(expected), enrich)  # only timers fire the pauses
        drain(flink_cluster, job.job_id, stack_dir)

    assert enrich.stats is not None
    acct = enrich.stats.accounting
    assert acct.balanced and acct.dead_lettered == 0 and acct.errors == 0, acct.as_dict()
    assert acct.prompts == len(expected) == acct.insights + acct.superseded
    stored = whole_records(isolated, f"{job_s3}/")
    assert set(stored) == set(expected)
    assert_latest_wins(expected, stored.values(), signal_versions(stack.redis_url, job_prefix))
    placed = read_topic_placed(stack.kafka_bootstrap, topics.prompts, expect=len(expected))
    assert sorted(str(orjson.loads(value)["request_id"]) for _, _, value in placed) == sorted(expected)
    assert all(key == orjson.loads(value)["shopper_id"].encode() for _, key, value in placed)
    assert len({partition for partition, _, _ in placed}) > 1, "every prompt on one partition"
    assert len(read_all(stack.kafka_bootstrap, topics.dlq, expect=n_bad)) == n_bad
