"""Real Kafka, Redis and MinIO in containers (testcontainers), used instead of the embedded processes
when a Docker engine answers. LLM replicas stay local processes (the simulator is a Python module).
Set ``SHOPPER_EMBEDDED=1`` to force the embedded stack even where Docker exists."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from devstack.stack import (
    StackSettings,
    StackState,
    _create_bucket,
    _create_topics,
    stack_down,
    stack_up,
    state_file,
    write_private,
)


def docker_available(timeout_s: float = 5.0) -> bool:
    """True when a Docker engine answers (the client alone is not enough)."""
    if os.environ.get("SHOPPER_EMBEDDED") == "1":
        return False
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


KAFKA_IMAGE = "confluentinc/cp-kafka:7.9.0"
"""testcontainers' ``KafkaContainer`` starts Confluent Platform images (its start script and its KRaft
check read their tags): cp-kafka 7.9 is Apache Kafka 3.9 (docker-compose runs apache/kafka 4.1; the
protocol the clients use is the same). Given apache/kafka:3.9.1, ``with_kraft()`` refused the tag
(3.9.1 < 7.0.0) and the suite failed at start wherever Docker answered."""

MINIO_IMAGE = "minio/minio:RELEASE.2025-04-22T22-12-26Z"
"""The compose stack's MinIO, pinned (``latest`` changed under the tests)."""


@contextmanager
def container_stack(
    state_dir: Path, replicas: int, time_scale: float, partitions: int
) -> Iterator[StackState]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.minio import MinioContainer
    from testcontainers.redis import RedisContainer

    with ExitStack() as containers:
        kafka = containers.enter_context(KafkaContainer(KAFKA_IMAGE).with_kraft())
        redis = containers.enter_context(RedisContainer("redis:7"))
        minio = containers.enter_context(MinioContainer(MINIO_IMAGE))
        bootstrap = kafka.get_bootstrap_server()
        redis_url = f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0"
        minio_config = minio.get_config()
        s3_url = f"http://{minio_config['endpoint']}"
        _create_topics(bootstrap, partitions)
        credentials = (minio_config["access_key"], minio_config["secret_key"])
        _create_bucket(s3_url, "shopper-understanding", credentials)
        settings = StackSettings(
            state_dir=state_dir,
            replicas=replicas,
            time_scale=time_scale,
            partitions=partitions,
            kafka_bootstrap=bootstrap,
            redis_url=redis_url,
            s3_endpoint_url=s3_url,
        )
        state = stack_up(settings)
        # The state file was written without them (stack_up knows moto's keys only): processes started
        # with --state-dir (a runner, a Flink job) read MinIO's keys from it.
        state.s3_access_key_id, state.s3_secret_access_key = credentials
        write_private(state_file(state_dir), state.to_json())
        try:
            yield state
        finally:
            stack_down(state_dir)


@contextmanager
def test_or_embedded_stack(
    state_dir: Path, replicas: int, time_scale: float, partitions: int
) -> Iterator[StackState]:
    """Containers where Docker answers, the embedded processes otherwise (used by the test suite)."""
    if docker_available():
        with container_stack(state_dir, replicas, time_scale, partitions) as state:
            yield state
        return
    state = stack_up(
        StackSettings(state_dir=state_dir, replicas=replicas, time_scale=time_scale, partitions=partitions)
    )
    try:
        yield state
    finally:
        stack_down(state_dir)
