"""``shopper flink up|down|status|submit`` and ``shopper demo --engine flink``: the job on a real
standalone Flink cluster (``devstack.flink_cluster``) next to the embedded stack, submitted with
``flink run`` and a config generated from the stack's addresses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.text import Text

from devstack.enrichment_stage import (
    enrichment_group,
    running_enrichment,
    stop_enrichment,
    stop_one_enrichment,
    submit_with_enrichment,
)
from devstack.errors import FlinkJobFailed
from devstack.flink_cluster import (
    FlinkClusterSettings,
    FlinkRest,
    cluster_dir,
    cluster_down,
    cluster_state_file,
    cluster_status,
    cluster_up,
    job_settings,
    load_cluster,
)
from devstack.processes import running
from devstack.stack import StackState, load_state
from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.kafka_security import KafkaSecurity, librdkafka_properties

if TYPE_CHECKING:
    from shopper.demo import DemoTopics

flink_app = typer.Typer(no_args_is_help=True, help="A local standalone Flink cluster and the job on it.")
StateDir = Annotated[Path, typer.Option(help="the stack's state dir (the cluster lives in its flink/)")]


START_TIMEOUT_S = FlinkClusterSettings.model_fields["start_timeout_s"].default


@flink_app.command("up")
def up(
    state_dir: StateDir = Path(".state"),
    start_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="seconds the JobManager's REST, then the TaskManagers' slots, may take to come up; past "
            "it, what was started is stopped and the command fails with one line naming the logs",
        ),
    ] = START_TIMEOUT_S,
) -> None:
    """Start a JobManager and TaskManagers from the PyFlink wheel on free ports."""
    state = cluster_up(state_dir, FlinkClusterSettings(start_timeout_s=start_timeout))
    typer.echo(f"Flink {state.web_url} (FLINK_HOME {state.flink_home}); logs in {state.log_dir}")


@flink_app.command("down")
def down(state_dir: StateDir = Path(".state")) -> None:
    """Stop exactly the processes 'shopper flink up' and 'submit' started: the enrichment runners first
    (their in-flight prompts finish and are stored), then the cluster."""
    stopped = stop_enrichment(state_dir) + cluster_down(state_dir)
    typer.echo("stopped: " + (", ".join(stopped) or "nothing"))


@flink_app.command("status")
def status(state_dir: StateDir = Path(".state")) -> None:
    found = cluster_status(state_dir)
    found["enrichment"] = {
        f"{p.name} ({p.pid})": f"up, /metrics on 127.0.0.1:{p.port}" if running(p) else "DOWN"
        for p in running_enrichment(state_dir)
    }
    typer.echo(json.dumps(found, indent=2))


def stack_job_settings(state_dir: Path, config: Path | None = None) -> NearRealtimeSettings:
    """Settings from the stack's addresses; fields in ``config`` (YAML/JSON) override them."""
    stack = load_state(state_dir)
    overrides = {} if config is None else NearRealtimeSettings.load(config).model_dump(exclude_unset=True)
    return job_settings(stack, state_dir, **overrides)


@flink_app.command("submit")
def submit_cmd(
    state_dir: StateDir = Path(".state"),
    config: Annotated[Path | None, typer.Option(help="YAML/JSON NearRealtimeSettings overrides")] = None,
    savepoint: Annotated[str | None, typer.Option(help="resume from this savepoint")] = None,
) -> None:
    """``flink run -d`` of flink_jobs/near_realtime.py with a config generated from the stack and, with
    the job's prompts topic (the default), the runner that enriches its prompts, as a process beside it
    ('shopper flink down' stops both)."""
    cluster = load_cluster(state_dir)
    settings = stack_job_settings(state_dir, config)
    path = cluster_dir(state_dir) / f"job-{uuid.uuid4().hex[:8]}.json"
    job, enrichment = submit_with_enrichment(
        cluster, state_dir, settings, config_path=path, savepoint=savepoint
    )
    typer.echo(f"job {job.job_id}\nweb UI {job.job_url}\nconfig {job.config}")
    if enrichment is not None:
        typer.echo(
            f"enrichment runner on {settings.prompts_topic} (pid {enrichment.pid}); "
            f"/metrics http://127.0.0.1:{enrichment.port}/metrics; log {enrichment.log}"
        )


def _consumer(bootstrap: str, group: str, security: KafkaSecurity | None) -> Consumer:
    """A consumer that never commits, with the TLS/SASL settings the demo's other clients use (the
    runner's, ``RUNNER_KAFKA_SECURITY__*``): before, these connected in plaintext whatever was set."""
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            **librdkafka_properties(security or KafkaSecurity()),
        }
    )


def topic_ends(
    bootstrap: str, topic: str, idle_s: float = 2.0, *, security: KafkaSecurity | None = None
) -> dict[int, int]:
    """Per partition, the offset after the last record (read, not asked: Tansu's ListOffsets(latest)
    counts batches)."""
    consumer = _consumer(bootstrap, f"ends-{uuid.uuid4().hex[:8]}", security)
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        ends: dict[int, int] = {}
        last = time.monotonic()
        while time.monotonic() - last < idle_s:
            message = consumer.poll(0.2)
            if message is not None and not message.error():
                partition, offset = message.partition(), message.offset()
                if partition is not None and offset is not None:
                    ends[partition] = offset + 1
                last = time.monotonic()
        return ends
    finally:
        consumer.close()


DEMO_WAIT_S = 600.0
"""How long the demo waits for the job, then for its enrichment runner, to commit what was produced."""


def wait_group_committed(
    bootstrap: str,
    group: str,
    topic: str,
    ends: dict[int, int],
    failed: Callable[[], str | None],
    within_s: float = DEMO_WAIT_S,
    *,
    security: KafkaSecurity | None = None,
) -> None:
    """Until ``group`` has committed ``ends`` of ``topic`` (every record read and its results stored);
    raises ``FlinkJobFailed`` with what ``failed`` says as soon as it says something, or when
    ``within_s`` has passed (a consumer alive but stuck: the replicas or a store down)."""
    # Reads the group's committed offsets only: it never joins the group, and never commits for it.
    consumer = _consumer(bootstrap, group, security)
    deadline = time.monotonic() + within_s
    try:
        while True:
            done = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=10)
            if all(tp.offset >= ends[tp.partition] for tp in done):
                return
            reason = failed() or (
                f"{group} did not commit {topic} within {within_s:g} s"
                if time.monotonic() > deadline
                else None
            )
            if reason is not None:
                raise FlinkJobFailed(reason)
            time.sleep(1.0)
    finally:
        consumer.close()


def run_flink_demo_step(
    state: StackState,
    state_dir: Path,
    *,
    prefix: str,
    s3_prefix: str,
    topics: DemoTopics,
    malformed: int,
    console: Console,
    security: KafkaSecurity | None = None,
) -> int:
    """Steps 3-4 of the demo on Flink: cluster up, ``flink run``, wait until a checkpoint covers every
    event, ``flink stop --drain`` (fires every pending trigger), cluster down, then what landed.
    ``topics``: the demo's own, so the job reads only its events and the DLQ holds only its dead letters.
    ``security``: the demo's own Kafka clients' TLS/SASL (the job's are ``FLINK_JOB_KAFKA__SECURITY__*``)."""
    settings = demo_job_settings(state, state_dir, prefix=prefix, s3_prefix=s3_prefix, topics=topics)
    _run_on_flink(state, state_dir, settings, console=console, security=security)
    import asyncio

    from devstack.stack import sink_settings
    from shopper.readback import cell, list_s3_records, read_dlq_values, read_signals

    console.rule("4. what landed")
    rows = asyncio.run(read_signals(state.redis_url, [], 8, prefix=prefix))
    for row in rows:
        console.print(
            Text.assemble(cell(row["shopper_id"]), "  v", cell(row["seq"]), "  ", cell(row["summary"]))
        )
    keys, records = list_s3_records(sink_settings(state), s3_prefix)
    dlq = read_dlq_values(state.kafka_bootstrap, topics.dlq, security=security)
    console.print(f"S3: {len(keys)} objects, {len(records)} records; DLQ {topics.dlq}: {len(dlq)} records")
    ok = bool(records) and len(dlq) == malformed
    console.print("[green]all accounted for[/green]" if ok else "[red]MISMATCH[/red]")
    return 0 if ok else 1


def demo_job_settings(
    state: StackState, state_dir: Path, *, prefix: str, s3_prefix: str, topics: DemoTopics
) -> NearRealtimeSettings:
    """The demo's job: the stack's addresses, the demo's topics (a prompts topic only where the job
    hands its prompts over), keys, S3 prefix and group. Production timers (a browse pause fires on the
    wall clock); the drain at the end fires whatever is still pending, so the demo need not wait out
    the last quiet period."""
    settings = job_settings(state, state_dir, flush_on_drain=True)
    kafka = {"group_id": f"demo-flink-{prefix}", "events_topic": topics.events, "dlq_topic": topics.dlq}
    return settings.model_copy(
        update={
            "sinks": settings.sinks.model_copy(update={"redis_key_prefix": prefix, "s3_prefix": s3_prefix}),
            "kafka": settings.kafka.model_copy(update=kafka),
            "prompts_topic": topics.prompts if settings.prompts_topic else None,
        }
    )


def _run_on_flink(
    state: StackState,
    state_dir: Path,
    settings: NearRealtimeSettings,
    *,
    console: Console,
    security: KafkaSecurity | None,
) -> None:
    before = load_cluster(state_dir) if cluster_state_file(state_dir).exists() else None
    cluster = cluster_up(state_dir)
    # A cluster the user had up already is theirs: the demo's job and its enrichment runner go, it stays.
    reused = before is not None and [p.pid for p in before.processes] == [p.pid for p in cluster.processes]
    console.print(
        f"Flink cluster {cluster.web_url}" + (" (up before the demo: left running)" if reused else "")
    )
    enrichment, job = None, None
    try:
        started = time.monotonic()
        job, enrichment = submit_with_enrichment(
            cluster, state_dir, settings, config_path=cluster_dir(state_dir) / "demo-job.json"
        )
        console.print(f"job {job.job_id} submitted with flink run in {time.monotonic() - started:.0f} s")
        if enrichment is not None:
            console.print(
                f"enrichment runner on {settings.prompts_topic}: /metrics on port {enrichment.port}"
            )
        rest = FlinkRest(cluster.web_url)

        def job_failed() -> str | None:
            state = rest.job_state(job.job_id)
            return f"job {job.job_id} is {state}" if state in {"FAILED", "CANCELED", "FINISHED"} else None

        events = settings.kafka.events_topic
        ends = topic_ends(state.kafka_bootstrap, events, security=security)
        wait_group_committed(
            state.kafka_bootstrap, settings.kafka.group_id, events, ends, job_failed, security=security
        )
        savepoint = (cluster_dir(state_dir) / "savepoints").resolve().as_uri()
        rest.stop_with_savepoint(job.job_id, savepoint, drain=True)
        console.print(f"every event consumed and checkpointed; drained in {time.monotonic() - started:.0f} s")
        if enrichment is not None and settings.prompts_topic:

            def runner_exited() -> str | None:
                return None if running(enrichment) else f"the enrichment runner exited; see {enrichment.log}"

            prompts = topic_ends(state.kafka_bootstrap, settings.prompts_topic, security=security)
            group = enrichment_group(settings)
            wait_group_committed(
                state.kafka_bootstrap,
                group,
                settings.prompts_topic,
                prompts,
                runner_exited,
                security=security,
            )
            console.print(f"every prompt answered and stored in {time.monotonic() - started:.0f} s")
    finally:
        if not reused:
            stop_enrichment(state_dir)
            cluster_down(state_dir)
        else:  # the demo's own job and runner go, not the user's
            rest = FlinkRest(cluster.web_url)
            if job is not None and rest.job_state(job.job_id) not in {"FINISHED", "CANCELED", "FAILED"}:
                rest.cancel(job.job_id)  # failed or interrupted before its drain: not left holding slots
            if enrichment is not None:
                stop_one_enrichment(state_dir, enrichment)
