"""Shared fixtures: one embedded stack (Tansu, Redis, moto S3, simulator replicas) per test session,
started and stopped by the tests themselves. Each test isolates itself with its own topic, consumer
group, Redis key prefix and S3 prefix, so tests never see each other's data."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis as sync_redis
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.containers import test_or_embedded_stack
from devstack.stack import StackState, sink_settings
from llm_client.config import ClientConfig, HealthSettings, Timeouts
from prompt_assembly.processor import SessionConfig
from runner.config import RunnerSettings
from sinks.config import SinkSettings
from tests.cancellation import pytest_configure  # noqa: F401  (SIGTERM stops what the fixtures started)
from tests.flink_failure_report import pytest_runtest_makereport  # noqa: F401  (the cluster's say, on failure)
from tests.kafka_client_leaks import no_kafka_client_left  # noqa: F401  (a test may not leave a Kafka client running)
from tests.timeout_report import pytest_timeout_set_timer  # noqa: F401  (a hung test's report ends with its id)

SIM_TIME_SCALE = 0.01
"""Simulated H100 timings at 1/100: a 4k-token prefill takes ~5 ms, a 200-token answer ~0.1 s."""


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """Kafka, Redis and MinIO in containers where a Docker engine answers; Tansu, the local Redis and
    moto otherwise. Either way the tests talk to real servers over the network."""
    state_dir = tmp_path_factory.mktemp("stack")
    with test_or_embedded_stack(state_dir, replicas=3, time_scale=SIM_TIME_SCALE, partitions=4) as state:
        yield state


@pytest.fixture(scope="session")
def broker_hides_aborted(stack: StackState) -> bool:
    """Whether the stack's broker hides aborted transactions from ``read_committed`` readers (Kafka
    does, Tansu 0.6.0 does not: ``devstack.broker_probe``), asked once per session."""
    from devstack.broker_probe import hides_aborted_transactions

    return hides_aborted_transactions(stack.kafka_bootstrap)


@pytest.fixture(scope="session")
def stack_dir(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(stack.processes[0].log).parent.parent


class Isolated:
    """Names and settings that belong to one test only."""

    def __init__(self, stack: StackState) -> None:
        self.stack = stack
        tag = uuid.uuid4().hex[:10]
        self.tag = tag
        self.topic = f"events-{tag}"
        self.dlq_topic = f"dlq-{tag}"
        self.insights_topic = f"insights-{tag}"
        self.prefix = f"test-{tag}:"
        self.s3_prefix = f"test-{tag}"
        self.group = f"group-{tag}"

    def create_topics(self, partitions: int = 4, bootstrap: str | None = None) -> None:
        """The test's topics, on the stack's broker unless ``bootstrap`` names another."""
        admin = AdminClient({"bootstrap.servers": bootstrap or self.stack.kafka_bootstrap})
        futures = admin.create_topics(
            [
                NewTopic(self.topic, partitions, 1),
                NewTopic(self.dlq_topic, 1, 1),
                NewTopic(self.insights_topic, 1, 1),
            ]
        )
        for future in futures.values():
            future.result(timeout=10)

    def sinks(self) -> SinkSettings:
        return sink_settings(
            self.stack,
            redis_key_prefix=self.prefix,
            s3_prefix=self.s3_prefix,
            s3_max_age_s=0.5,
            insights_topic=self.insights_topic,
        )

    def runner(self, **overrides: object) -> RunnerSettings:
        options: dict[str, object] = {
            "bootstrap_servers": self.stack.kafka_bootstrap,
            "group_id": self.group,
            "topic": self.topic,
            "dlq_topic": self.dlq_topic,
            "until_drained": True,
            "commit_interval_s": 0.3,
            "progress_interval_s": 5.0,
            # Timers never fire on the wall clock in tests: pending triggers fire from event time or
            # at the final drain, which makes the expected prompts exactly computable offline.
            "timer_wall_per_event_s": 1000.0,
            "session": SessionConfig(),
            "llm": self.llm(),
            "sinks": self.sinks(),
        }
        options.update(overrides)
        return RunnerSettings(**options)  # type: ignore[arg-type]

    def llm(self, **overrides: object) -> ClientConfig:
        options: dict[str, object] = {
            "endpoints": self.stack.stream_endpoints,  # what `shopper run --from-stack` calls: the gateway
            "model": self.stack.model,
            "timeouts": Timeouts(connect_s=2, attempt_s=20, deadline_s=60),
            "health": HealthSettings(interval_s=0.2),
        }
        options.update(overrides)
        return ClientConfig(**options)  # type: ignore[arg-type]

    def cleanup(self) -> None:
        client = sync_redis.Redis.from_url(self.stack.redis_url)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def isolated(stack: StackState) -> Iterator[Isolated]:
    iso = Isolated(stack)
    iso.create_topics()
    yield iso
    iso.cleanup()


@pytest.fixture
async def redis_client(stack: StackState) -> AsyncIterator[object]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(stack.redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def flink_cluster(stack: StackState, stack_dir: Path) -> Iterator[object]:
    """A standalone Flink cluster (JobManager + TaskManager from the PyFlink wheel), started once per
    session for the tests that submit the job with ``flink run``, and stopped at the end."""
    from devstack.flink_cluster import cluster_down, cluster_up

    state = cluster_up(stack_dir)
    try:
        yield state
    finally:
        cluster_down(stack_dir)


@pytest.fixture(autouse=True)
def _no_flink_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the Flink cluster: cancel any job it left running (a test that fails
    mid-job leaves it holding slots) and bring back a lost TaskManager's slots, so one failure stays
    one failure and does not starve the next tests' jobs."""
    yield
    if "flink_cluster" not in request.fixturenames:
        return
    from devstack.flink_cluster import FlinkClusterSettings, FlinkRest, save_cluster, start_taskmanager

    cluster, stack_dir = request.getfixturevalue("flink_cluster"), request.getfixturevalue("stack_dir")
    rest = FlinkRest(cluster.web_url)
    rest.cancel_unfinished()
    settings = FlinkClusterSettings()
    slots = settings.taskmanagers * settings.task_slots
    try:
        rest.wait_for_slots(slots, timeout_s=30)  # a replacement TaskManager may still be registering
    except TimeoutError:
        registered = int(rest.get("/overview")["taskmanagers"])
        for n in range(registered, settings.taskmanagers):
            start_taskmanager(cluster, name=f"flink-taskmanager-restored-{n + 1}")
        save_cluster(stack_dir, cluster)
        rest.wait_for_slots(slots, timeout_s=settings.start_timeout_s)
