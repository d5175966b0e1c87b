"""The Flink job's enrichment stage: a runner with input 'prompts' on the job's prompts topic
(``NearRealtimeSettings.prompts_topic``, on by default), with settings derived from the job's own.

Why derived: the two deployables must agree on the Kafka cluster and its security, the LLM fleet, the
enrichment policy (latest wins, priority, the answer ledger), the dead-letter topic and the sinks, or
the job's prompts are answered into a store the ad servers do not read. ``shopper flink submit`` starts
one beside each job it submits, as a process of its own (``python -m devstack.enrichment_stage
JOB_CONFIG``, the job's own config file); ``shopper flink down`` stops it as SIGTERM stops
``shopper run``: in-flight prompts finish, then one last durable point and commit. The compose file and
the Kubernetes manifests run the same runner as ``shopper run`` with ``RUNNER_INPUT=prompts``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from devstack.errors import FlinkJobFailed
from devstack.flink_cluster import FlinkClusterState, SubmittedJob, cluster_dir, submit
from devstack.processes import ManagedProcess, free_port, interrupts_deferred, spawn, stop, wait_for_http
from devstack.stack import write_private
from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.kafka_security import librdkafka_properties
from prompt_assembly.errors import ConfigurationError
from runner.config import RunnerSettings

STOP_TIMEOUT_S = 120.0
"""How long ``stop_enrichment`` lets a runner finish its in-flight prompts before it is killed (a
killed one re-pays nothing: its prompts are read again and answered from the ledger)."""


def enrichment_group(job: NearRealtimeSettings) -> str:
    """The enrichment runner's consumer group: the job's own, suffixed (each reads a different topic)."""
    return f"{job.kafka.group_id}-enrich"


def enrichment_settings(job: NearRealtimeSettings, **overrides: Any) -> RunnerSettings:
    """The runner that enriches ``job``'s prompts: the job's Kafka cluster, security and fetch wait,
    LLM, enrichment, sink and dead-letter settings, in a consumer group of its own (``<job group>-enrich``).
    The runner's other settings (its metrics host, log format, in-flight bounds) come from ``RUNNER_*``
    as for ``shopper run``. ``overrides`` are ``RunnerSettings`` fields."""
    if not job.prompts_topic:
        raise ConfigurationError("the job has no prompts_topic: its own async stage enriches its prompts")
    options: dict[str, Any] = {
        "bootstrap_servers": job.kafka.bootstrap_servers,
        "kafka_security": job.kafka.security,
        # the source's wait (its consumer_properties win over the field, as in the job's source)
        "kafka_fetch_wait_max_ms": int(
            job.kafka.consumer_properties.get("fetch.max.wait.ms", job.kafka.fetch_max_wait_ms)
        ),
        "group_id": enrichment_group(job),
        "topic": job.prompts_topic,
        "input": "prompts",
        "until_drained": False,  # a stage of a running job, never a batch that ends
        "dlq_topic": job.kafka.dlq_topic,
        "dlq_max_original_bytes": job.dlq_max_original_bytes,
        "sink_retry": job.sink_retry,
        "llm": job.llm,
        "enrichment": job.enrichment,
        "sinks": job.sinks,
    }
    options.update(overrides)
    return RunnerSettings(**options)


def create_prompts_topic(job: NearRealtimeSettings) -> None:
    """The job's prompts topic, unless it exists, with as many partitions as its events topic (so the
    enrichment scales, as a consumer group, as far as the job's sources do)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    if not job.prompts_topic:
        return
    config: dict[str, str | int | float | bool] = {
        "bootstrap.servers": job.kafka.bootstrap_servers,
        **librdkafka_properties(job.kafka.security),
    }
    admin = AdminClient(config)
    topics = admin.list_topics(timeout=10).topics
    if job.prompts_topic in topics:
        return
    events = topics.get(job.kafka.events_topic)
    partitions = len(events.partitions) if events is not None and events.partitions else 1
    try:
        admin.create_topics([NewTopic(job.prompts_topic, partitions, 1)])[job.prompts_topic].result(
            timeout=10
        )
    except KafkaException as error:  # made meanwhile (a broker that creates topics on first use)
        if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise


def enrichment_state_file(state_dir: Path) -> Path:
    return cluster_dir(state_dir) / "enrichment.json"


def running_enrichment(state_dir: Path) -> list[ManagedProcess]:
    """The enrichment runners ``start_enrichment`` started and ``stop_enrichment`` has not stopped."""
    path = enrichment_state_file(state_dir)
    if not path.exists():
        return []
    return [ManagedProcess(**row) for row in json.loads(path.read_text())]


def start_enrichment(state_dir: Path, job: NearRealtimeSettings, config_path: Path) -> ManagedProcess:
    """Start the enrichment runner of ``job``, whose config ``submit`` wrote to ``config_path`` (it holds
    the job's secrets, readable by its owner only, so the runner reads it as the job does); returns once
    it is alive and serving (``/health/live``; ready only once it owns partitions). Its ``/metrics`` is on
    the port it returns. A runner this state dir started for the same consumer group is stopped first
    (a resubmitted job replaces its runner, settings and all); it is recorded before it is waited for,
    so ``stop_enrichment`` finds it even if this process dies meanwhile."""
    name = f"enrichment-{enrichment_group(job)}"
    for previous in running_enrichment(state_dir):
        if previous.name == name:
            stop(previous, timeout_s=STOP_TIMEOUT_S)
            _save(state_dir, [p for p in running_enrichment(state_dir) if p.pid != previous.pid])
    port = free_port()
    argv = [sys.executable, "-m", "devstack.enrichment_stage", str(config_path), "--metrics-port", str(port)]
    with interrupts_deferred():  # forked and saved before an interrupt (the CLI's SIGTERM) can come
        process = spawn(name, argv, port, cluster_dir(state_dir) / "log")
        _save(state_dir, [*running_enrichment(state_dir), process])
    try:
        wait_for_http(process, "/health/live", timeout_s=60)
    except BaseException:
        stop(process)
        _save(state_dir, [p for p in running_enrichment(state_dir) if p.pid != process.pid])
        raise
    return process


def stop_enrichment(state_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """SIGTERM every enrichment runner this state dir started (killed after ``timeout_s``); their names."""
    processes = running_enrichment(state_dir)
    for process in processes:
        stop(process, timeout_s=timeout_s)
    enrichment_state_file(state_dir).unlink(missing_ok=True)
    return [p.name for p in processes]


def stop_one_enrichment(state_dir: Path, process: ManagedProcess, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop one enrichment runner this state dir started and forget it (the others run on)."""
    stop(process, timeout_s=timeout_s)
    _save(state_dir, [p for p in running_enrichment(state_dir) if p.pid != process.pid])


def submit_with_enrichment(
    cluster: FlinkClusterState,
    state_dir: Path,
    settings: NearRealtimeSettings,
    *,
    config_path: Path,
    savepoint: str | None = None,
) -> tuple[SubmittedJob, ManagedProcess | None]:
    """``flink run`` of the job and, when it has a prompts topic (the default), its enrichment runner
    beside it; the runner is None when the job's own async stage enriches. The topic is made (unless the
    stack made it) once ``flink run`` has accepted the job, which then still has to deploy its tasks:
    seconds, against the milliseconds the topic takes, and its producer waits for the topic's metadata
    in any case (``max.block.ms``). If the runner cannot start, the job keeps running and its prompts
    wait in their topic: the error says so, with the job's id and how to start the runner by hand."""
    job = submit(cluster, settings, config_path=config_path, savepoint=savepoint)
    if not settings.prompts_topic:
        return job, None
    try:
        create_prompts_topic(settings)
        return job, start_enrichment(state_dir, settings, config_path)
    except Exception as error:
        raise FlinkJobFailed(
            f"job {job.job_id} runs, but its enrichment runner did not start ({error}); its prompts wait in "
            f"{settings.prompts_topic}. Start it with `python -m devstack.enrichment_stage {config_path}`, "
            "or cancel the job"
        ) from error


def _save(state_dir: Path, processes: list[ManagedProcess]) -> None:
    path = enrichment_state_file(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps([asdict(p) for p in processes]))  # whole, never half written


def main(argv: list[str] | None = None) -> None:
    """Run the enrichment runner of the job configured in JOB_CONFIG until SIGTERM."""
    from runner.embedded import EmbeddedRunner

    parser = argparse.ArgumentParser(prog="python -m devstack.enrichment_stage", description=main.__doc__)
    parser.add_argument(
        "job_config", type=Path, help="the job's config JSON, as `shopper flink submit` writes it"
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="/metrics and /health on this port")
    args = parser.parse_args(argv)
    job = NearRealtimeSettings.from_json(args.job_config.read_text())
    settings = enrichment_settings(job, metrics_port=args.metrics_port)
    asyncio.run(EmbeddedRunner(settings, log=lambda line: print(line, file=sys.stderr, flush=True)).run())


if __name__ == "__main__":
    main()
