"""Kafka source and sinks of the job, from the official Flink Kafka connector jar.

The connector is not on PyPI and is not part of the PyFlink wheel; ``scripts/fetch-flink-connectors``
downloads the pinned jar into ``flink_jobs/lib/`` (the compose image bakes it into ``/opt/flink/lib``).
``kafka_connector_jars`` fails fast, before any Java class is touched, with a message naming the script.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.kafka_security import java_kafka_properties

LIB_DIR = Path(__file__).resolve().parent / "lib"
JAR_GLOB = "flink-sql-connector-kafka-*.jar"
FETCH_SCRIPT = "scripts/fetch-flink-connectors"


class MissingConnectorJar(RuntimeError):
    """The Kafka connector jar is on neither the job's lib folder nor the cluster's classpath."""


def find_kafka_connector_jars() -> list[Path]:
    """Jars the job must ship (``flink_jobs/lib``, ``$FLINK_CONNECTOR_JARS``), or on the cluster's lib."""
    found = sorted(LIB_DIR.glob(JAR_GLOB))
    extra = os.environ.get("FLINK_CONNECTOR_JARS")
    if extra:
        found += [Path(p) for p in extra.split(os.pathsep) if p]
    flink_home = os.environ.get("FLINK_HOME")
    if flink_home:
        found += sorted((Path(flink_home) / "lib").glob(JAR_GLOB))
    return [p for p in found if p.is_file()]


def kafka_connector_jars() -> list[str]:
    """``file://`` URLs to add to the job; raises ``MissingConnectorJar`` naming the fetch script."""
    jars = find_kafka_connector_jars()
    if not jars:
        raise MissingConnectorJar(
            f"the Flink Kafka connector jar ({JAR_GLOB}) was not found in {LIB_DIR}, "
            f"$FLINK_CONNECTOR_JARS or $FLINK_HOME/lib. Run `{FETCH_SCRIPT}` (it downloads the pinned, "
            "checksummed jar into flink_jobs/lib/), or use the compose Flink image, which has it baked in."
        )
    flink_home = os.environ.get("FLINK_HOME")
    if flink_home and all(str(j).startswith(str(Path(flink_home) / "lib")) for j in jars):
        return []  # already on the cluster classpath; shipping it again would load it twice
    return [j.resolve().as_uri() for j in jars]


def kafka_source(settings: NearRealtimeSettings, *, stop_at_latest: bool = False) -> Any:
    """The official ``KafkaSource``: committed group offsets, falling back to earliest on a new group.

    Values are read as UTF-8 strings (``SimpleStringSchema``); invalid bytes become U+FFFD and then
    fail validation into the DLQ. The value-only deserializer does not expose partition/offset.
    """
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.kafka import (
        KafkaOffsetResetStrategy,
        KafkaOffsetsInitializer,
        KafkaSource,
    )

    kafka = settings.kafka
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(kafka.bootstrap_servers)
        .set_topics(kafka.events_topic)
        .set_group_id(kafka.group_id)
        .set_starting_offsets(KafkaOffsetsInitializer.committed_offsets(KafkaOffsetResetStrategy.EARLIEST))
        .set_value_only_deserializer(SimpleStringSchema())
        .set_property("commit.offsets.on.checkpoint", "true")
        .set_property("partition.discovery.interval.ms", "60000")
    )
    for key, value in {**java_kafka_properties(kafka.security), **kafka.consumer_properties}.items():
        builder = builder.set_property(key, value)
    if stop_at_latest:  # a bounded read of what is in the topic now (tests, backfills)
        builder = builder.set_bounded(KafkaOffsetsInitializer.latest())
    return builder.build()


def kafka_sink(settings: NearRealtimeSettings, topic: str, *, exactly_once: bool) -> Any:
    """A ``KafkaSink`` of JSON strings. Exactly-once uses Kafka transactions committed on checkpoints,
    with an explicit ``transaction.timeout.ms`` (the broker caps it at ``transaction.max.timeout.ms``)."""
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.base import DeliveryGuarantee
    from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink

    kafka = settings.kafka
    serializer = (
        KafkaRecordSerializationSchema.builder()
        .set_topic(topic)
        .set_value_serialization_schema(SimpleStringSchema())
        .build()
    )
    builder = (
        KafkaSink.builder()
        .set_bootstrap_servers(kafka.bootstrap_servers)
        .set_record_serializer(serializer)
        .set_property("transaction.timeout.ms", str(kafka.transaction_timeout_ms))
    )
    for key, value in java_kafka_properties(kafka.security).items():
        builder = builder.set_property(key, value)
    if exactly_once:
        builder = builder.set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE).set_transactional_id_prefix(
            f"{kafka.transactional_id_prefix}-{topic}"
        )
    else:
        builder = builder.set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
    return builder.build()
