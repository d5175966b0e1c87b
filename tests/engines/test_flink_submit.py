"""The code ``shopper flink submit`` runs (``devstack.enrichment_stage.submit_with_enrichment``): the job
at its defaults on the standalone cluster and, beside it, its enrichment runner as a process of its own
(``python -m devstack.enrichment_stage JOB_CONFIG``, settings derived from the job's config file), as
the compose file and the Kubernetes manifests deploy the two. A shopper's cart add is answered into the
store the job's settings name; the runner's ``/metrics`` counts it; ``stop_enrichment`` (the first step
of ``shopper flink down``, here after the job is cancelled, since the session's cluster stays up) stops
the runner with SIGTERM, after which its group has committed the prompts topic to its end: nothing
taken was left unstored. The CLI commands around it run in ``tests/shopper/test_demo.py`` (the Flink
demo) and ``tests/security/test_security_cli_output.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devstack.enrichment_stage import (
    enrichment_group,
    running_enrichment,
    stop_enrichment,
    submit_with_enrichment,
)
from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.processes import alive
from devstack.stack import StackState
from shopper.flink_cli import topic_ends
from tests.conftest import Isolated
from tests.engines.test_engine_agreement import cart_add, signals
from tests.flink_kit import cluster_job_settings, committed, flink_topics, produce
from tests.helpers import prometheus_total

pytestmark = [pytest.mark.flink, pytest.mark.slow]

LANDED_WITHIN_S = 120.0
"""A wait, not a measure: the job's start on the cluster and one model call."""


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LANDED_WITHIN_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {LANDED_WITHIN_S:g} s: {what}")
        time.sleep(0.5)


def test_submit_starts_the_enrichment_runner_and_down_stops_it_after_its_last_commit(
    isolated: Isolated, stack: StackState, stack_dir: Path, flink_cluster: FlinkClusterState
) -> None:
    topics = flink_topics(isolated)
    prefix = f"{isolated.prefix}flink:"
    settings = cluster_job_settings(
        stack, stack_dir, isolated, topics, prefix=prefix, s3_prefix=f"{isolated.s3_prefix}-flink"
    )
    config = stack_dir / "flink" / f"job-{isolated.tag}.json"
    job, enrichment = submit_with_enrichment(flink_cluster, stack_dir, settings, config_path=config)
    rest = FlinkRest(flink_cluster.web_url)
    try:
        assert enrichment is not None and alive(enrichment.pid)
        assert [p.pid for p in running_enrichment(stack_dir)] == [enrichment.pid]
        rest.wait_running(job.job_id)
        produce(stack.kafka_bootstrap, topics.events, [(b"s-cart", cart_add("s-cart", 0, time.time()))])
        wait_for(lambda: "s-cart" in signals(stack.redis_url, prefix), "the cart add's signal in Redis")
        metrics = [f"http://127.0.0.1:{enrichment.port}/metrics"]
        wait_for(
            lambda: prometheus_total(metrics, "shopper_insights_written_total") == 1, "one insight counted"
        )
    finally:
        rest.cancel(job.job_id)
        stopped = stop_enrichment(stack_dir)
    assert enrichment is not None
    assert stopped == [enrichment.name] and not alive(enrichment.pid) and running_enrichment(stack_dir) == []
    assert "Traceback" not in Path(enrichment.log).read_text(errors="replace")
    ends = topic_ends(stack.kafka_bootstrap, topics.prompts)
    assert sum(ends.values()) >= 1, "the job sent no prompt to its topic"
    group = enrichment_group(settings)
    assert committed(stack.kafka_bootstrap, group, topics.prompts, sorted(ends)) == ends
