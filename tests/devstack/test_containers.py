"""The container stack (where a Docker engine answers) uses images testcontainers can start. This
machine has no Docker, so what is checked here is what can be without one: the Kafka image passes
testcontainers' own KRaft check (apache/kafka:3.9.1 did not, and the suite failed at start wherever
Docker answered), and MinIO is pinned, to the compose stack's image."""

from __future__ import annotations

from pathlib import Path

import yaml
from testcontainers.core.version import ComparableVersion
from testcontainers.kafka import KafkaContainer

from devstack.containers import KAFKA_IMAGE, MINIO_IMAGE

REPO = Path(__file__).resolve().parents[2]


def test_the_kafka_image_is_one_testcontainers_starts_in_kraft_mode() -> None:
    repository, tag = KAFKA_IMAGE.rsplit(":", 1)
    assert repository == "confluentinc/cp-kafka", "KafkaContainer's start script is Confluent's"
    assert ComparableVersion(tag) >= KafkaContainer.MIN_KRAFT_TAG
    assert not ComparableVersion("3.9.1") >= KafkaContainer.MIN_KRAFT_TAG, "the check this guards against"


def test_minio_is_pinned_to_the_compose_stacks_image() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert compose["services"]["minio"]["image"] == MINIO_IMAGE and not MINIO_IMAGE.endswith(":latest")
