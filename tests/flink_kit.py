"""Helpers of the tests that run the job with ``flink run`` on the standalone cluster over Tansu.

Why the tests wait on committed offsets, not on the topic's end offset: the job commits its group's
offsets on each completed checkpoint, so "committed == what we produced" means a checkpoint covering
every record has completed (and Tansu's ListOffsets(latest) counts batches, not records, so a bounded
``latest-offset`` read would stop early; the producer's own delivery reports give the true ends).
The job runs with its production timers (``wall_clock_timers`` on: a pending trigger fires on the wall
clock, ``flink_jobs.pause_timers``) and ``flush_on_drain`` on, and ends with ``flink stop --drain``,
which fires whatever is still pending. The prompts equal the offline oracle
(``tests.helpers.expected_prompts``) and the embedded runner's wherever each shopper's events are read
within one quiet period of each other (a backlog produced before the job starts is read at once).
Tests whose input arrives in parts across a TaskManager kill or a rescale pass
``wall_clock_timers=False``: a restored timer races the replayed and the later events, so their prompts
would depend on timing, and what they check is that nothing is lost or repeated.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.enrichment_stage import enrichment_group, enrichment_settings
from devstack.flink_cluster import FlinkClusterState, FlinkRest, SubmittedJob, job_settings, submit
from devstack.runner_thread import RunnerThread
from devstack.stack import StackState
from flink_jobs.flink_config import AsyncSettings, CheckpointSettings, KafkaSettings, NearRealtimeSettings
from shopper.flink_cli import topic_ends, wait_group_committed
from shopper.readback import read_topic
from tests.conftest import Isolated


@dataclass
class FlinkTopics:
    events: str
    dlq: str
    insights: str
    prompts: str
    group: str


def produce(
    bootstrap: str,
    topic: str,
    records: list[tuple[bytes | None, bytes | None]],
    config: Mapping[str, str | int | float | bool] | None = None,
) -> dict[int, int]:
    """Produce ``(key, value)`` records in order (``value`` None is a tombstone); returns, per
    partition, the offset after the last record (from the delivery reports). ``config``: more client
    settings (TLS)."""
    ends: dict[int, int] = {}

    def delivered(error: KafkaError | None, message: Message) -> None:
        assert error is None, error
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        ends[partition] = max(ends.get(partition, 0), offset + 1)

    producer = Producer(
        {"bootstrap.servers": bootstrap, **(config or {}), "linger.ms": 5, "message.max.bytes": 4_000_000}
    )
    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
    assert producer.flush(30) == 0
    return ends


def committed(bootstrap: str, group: str, topic: str, partitions: list[int]) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        consumer.close()


def wait_committed(
    bootstrap: str, group: str, topic: str, ends: dict[int, int], rest: FlinkRest, job_id: str
) -> None:
    """Until the job's group has committed every produced record (a checkpoint covers them all)."""
    deadline = time.monotonic() + 240
    seen: dict[int, int] = {}
    while time.monotonic() < deadline:
        seen = committed(bootstrap, group, topic, sorted(ends))
        if all(seen.get(p, -1) >= end for p, end in ends.items()):
            return
        state = rest.job_state(job_id)
        assert state in {"RUNNING", "RESTARTING", "INITIALIZING", "CREATED"}, f"job is {state}"
        time.sleep(1.0)
    raise TimeoutError(f"group {group} committed {seen}, produced up to {ends}; {rest.diagnosis(job_id)}")


def read_all(bootstrap: str, topic: str, *, expect: int = 0) -> list[bytes]:
    """Every record of ``topic`` read with ``read_committed`` to its end (``shopper.readback.read_topic``):
    call it once the job committed past every input offset and was drained."""
    return read_topic(bootstrap, topic, expect=expect, read_committed=True)


def flink_topics(isolated: Isolated, partitions: int = 4) -> FlinkTopics:
    """The events topic is the isolated one; the job gets its own DLQ, insights and prompts topics and
    group (the prompts topic with the events topic's partitions, as ``submit_with_enrichment`` makes it)."""
    topics = FlinkTopics(
        events=isolated.topic,
        dlq=f"flink-dlq-{isolated.tag}",
        insights=f"flink-insights-{isolated.tag}",
        prompts=f"flink-prompts-{isolated.tag}",
        group=f"flink-{isolated.group}",
    )
    admin = AdminClient({"bootstrap.servers": isolated.stack.kafka_bootstrap})
    new = [
        NewTopic(topics.dlq, 1, 1),
        NewTopic(topics.insights, 2, 1),
        NewTopic(topics.prompts, partitions, 1),
    ]
    for future in admin.create_topics(new).values():
        future.result(timeout=10)
    return topics


def cluster_job_settings(
    stack: StackState,
    state_dir: Path,
    isolated: Isolated,
    topics: FlinkTopics,
    *,
    prefix: str,
    s3_prefix: str,
    wall_clock_timers: bool = True,
    async_stage: bool = False,
) -> NearRealtimeSettings:
    """The job's settings as ``shopper flink submit`` makes them, narrowed to this test's names: its
    prompts go to this test's prompts topic, for ``enrichment_runner`` to answer, unless
    ``async_stage`` says the job's own async stage enriches (``prompts_topic`` None)."""
    return job_settings(
        stack,
        state_dir,
        kafka=KafkaSettings(
            bootstrap_servers=stack.kafka_bootstrap,
            events_topic=topics.events,
            dlq_topic=topics.dlq,
            group_id=topics.group,
            transactional_id_prefix=f"tx-{isolated.tag}",
        ),
        checkpoint=CheckpointSettings(
            interval_ms=2_000,
            min_pause_ms=500,
            directory=(state_dir / "flink" / "checkpoints").resolve().as_uri(),
        ),
        async_io=AsyncSettings(capacity=64, bundle_time_ms=200),
        llm=isolated.llm(),
        sinks=isolated.sinks().model_copy(
            update={"redis_key_prefix": prefix, "s3_prefix": s3_prefix, "insights_topic": topics.insights}
        ),
        wall_clock_timers=wall_clock_timers,
        flush_on_drain=True,
        prompts_topic=None if async_stage else topics.prompts,
    )


def async_stage_job_settings(
    stack: StackState,
    state_dir: Path,
    isolated: Isolated,
    topics: FlinkTopics,
    *,
    prefix: str,
    s3_prefix: str,
) -> NearRealtimeSettings:
    """``cluster_job_settings`` for the tests of the job's own async stage (``prompts_topic`` empty: its
    calls, writes and exactly-once insights topic under a TaskManager kill, a rescale or a fault) whose
    input arrives in parts: prompts by event order (``wall_clock_timers`` off, this module's docstring).
    The default path's own kill test is ``test_a_taskmanager_killed_at_the_defaults_re_pays_no_call``."""
    return cluster_job_settings(
        stack,
        state_dir,
        isolated,
        topics,
        prefix=prefix,
        s3_prefix=s3_prefix,
        wall_clock_timers=False,
        async_stage=True,
    )


@contextmanager
def enrichment_runner(
    isolated: Isolated, settings: NearRealtimeSettings, **overrides: Any
) -> Iterator[RunnerThread]:
    """The runner that answers the job's prompts, with the settings ``shopper flink submit`` derives
    from the job's (``devstack.enrichment_stage``), on a thread of the test's process until the block
    ends; then stopped as SIGTERM stops it (its stats on ``.stats``). ``overrides``: RunnerSettings
    fields (a metrics port, the commit interval the tests' runners use)."""
    options: dict[str, Any] = {"commit_interval_s": 0.3, "progress_interval_s": 5.0, **overrides}
    runner = RunnerThread(enrichment_settings(settings, **options)).start()
    try:
        yield runner
    finally:
        runner.stop()


def wait_enriched(bootstrap: str, settings: NearRealtimeSettings, runner: RunnerThread) -> None:
    """Until the job's enrichment runner has committed its prompts topic to the end (every prompt the job
    sent is answered and stored), as the Flink demo waits for it: call it after the job is drained,
    before the runner is stopped."""
    assert settings.prompts_topic, "the job has no enrichment runner"
    topic = settings.prompts_topic
    ends = topic_ends(bootstrap, topic)  # read, not asked (this module's docstring)

    def runner_failed() -> str | None:
        return None if runner.error is None else f"the enrichment runner failed: {runner.error!r}"

    wait_group_committed(bootstrap, enrichment_group(settings), topic, ends, runner_failed, within_s=240)


def run_job(
    cluster: FlinkClusterState,
    settings: NearRealtimeSettings,
    state_dir: Path,
    *,
    savepoint: str | None = None,
) -> SubmittedJob:
    job = submit(
        cluster,
        settings,
        config_path=state_dir / "flink" / f"job-{uuid.uuid4().hex[:8]}.json",
        savepoint=savepoint,
    )
    FlinkRest(cluster.web_url).wait_running(job.job_id)
    return job


def drain(cluster: FlinkClusterState, job_id: str, state_dir: Path) -> str:
    """``flink stop --drain``: fire every pending trigger, commit, finish; returns the savepoint."""
    rest = FlinkRest(cluster.web_url)
    location = rest.stop_with_savepoint(
        job_id, (state_dir / "flink" / "savepoints").resolve().as_uri(), drain=True
    )
    rest.wait_for_state(job_id, {"FINISHED"})
    return location


def request_ids(values: list[bytes]) -> list[str]:
    return [str(orjson.loads(v)["request_id"]) for v in values]


def subtask_counters(rest: FlinkRest, job_id: str, vertex: str, metric: str) -> list[int]:
    """Per subtask of the vertex whose name contains ``vertex``, the value of the operator metric whose
    name ends with ``metric`` (0 where the subtask has not reported it yet). The REST API refreshes its
    metrics every few seconds, so callers poll."""
    job = rest.get(f"/jobs/{job_id}")
    (found,) = [v for v in job["vertices"] if vertex in v["name"]]
    values: list[int] = []
    for index in range(int(found["parallelism"])):
        path = f"/jobs/{job_id}/vertices/{found['id']}/subtasks/{index}/metrics"
        names = [m["id"] for m in rest.get(path) if str(m["id"]).endswith(metric)]
        if not names:
            values.append(0)
            continue
        (row,) = rest.get(f"{path}?get={names[0]}")
        values.append(int(float(row["value"])))
    return values
