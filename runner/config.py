"""Embedded runner configuration (env prefix ``RUNNER_``; nested components keep their own models).

A component's field has two environment names, ``RUNNER_LLM__MODEL`` and the component's own
``LLM_MODEL`` (``SINK_*`` for ``sinks``): either works, both at once is a ``ConfigurationError``
(``pipeline.setting_names``)."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llm_client.config import ClientConfig
from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES
from pipeline.enrichment import EnrichmentSettings, refuse_reading_on_superseded
from pipeline.kafka_security import KafkaSecurity
from pipeline.setting_names import refuse_settings_named_twice
from pipeline.sink_retry import SinkRetry
from pipeline.topics import DLQ_TOPIC, EVENTS_TOPIC
from prompt_assembly.processor import SessionConfig
from runner.logs import LogFormat
from sinks.config import SinkSettings

_NOT_IN_TOPIC_NAMES = re.compile(r"[^A-Za-z0-9._-]")
"""A character Kafka refuses in a topic name."""


class RunnerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RUNNER_", env_nested_delimiter="__", hide_input_in_errors=True
    )

    bootstrap_servers: str = "127.0.0.1:9092"
    kafka_security: KafkaSecurity = Field(
        default_factory=KafkaSecurity,
        description="TLS/SASL for every Kafka client (pipeline.kafka_security.librdkafka_properties)",
    )
    group_id: str = "shopper-understanding"
    topic: str = EVENTS_TOPIC
    input: Literal["events", "prompts"] = Field(
        "events",
        description="what ``topic`` holds: shopper events (the whole pipeline), or prompts a session "
        "stage made elsewhere (the Flink job with ``prompts_topic``), keyed by shopper id, which this "
        "runner only enriches and stores (runner.prompt_intake)",
    )
    dlq_topic: str = DLQ_TOPIC
    batch_max_events: int = Field(2000, ge=1, description="events per poll (one epoch)")
    poll_timeout_s: float = Field(0.05, gt=0)
    max_in_flight_prompts: int = Field(
        512,
        ge=1,
        description="prompts at the fleet or storing their result; beyond it partitions are paused",
    )
    max_waiting_prompts: int = Field(
        4096,
        ge=0,
        description="prompts waiting at the admission gate that do not count against max_in_flight_prompts "
        "(latest wins: at most one per shopper, replaceable by a newer trigger only while the consumer "
        "reads; a prompt is about 15 KB, so 4,096 are about 60 MB)",
    )
    commit_interval_s: float = Field(
        1.0, gt=0, description="how often results are made durable (S3 flush, sessions, offsets)"
    )
    session_cache_size: int = Field(200_000, ge=100, description="sessions kept in memory")
    timer_wall_per_event_s: float = Field(
        1.0, ge=0, description="wall seconds a pending trigger waits per event-time second"
    )
    kafka_session_timeout_ms: int = Field(
        6000,
        ge=1000,
        description="Tansu holds a group join for about half of this; librdkafka's 45 s default "
        "means a 23 s wait before the first message",
    )
    kafka_fetch_wait_max_ms: int = Field(
        100,
        gt=0,
        description="the consumer's fetch.wait.max.ms (librdkafka's default is 500). Tansu holds a fetch "
        "this long instead of answering when data arrives, so each record waited up to it; on Kafka it "
        "only bounds the idle fetch rate (as the Flink job's kafka.fetch_max_wait_ms)",
    )
    rekey_partitioner: Literal[
        "consistent_random", "consistent", "murmur2_random", "murmur2", "fnv1a_random", "fnv1a"
    ] = Field(
        "consistent_random",
        description="which partition of the repartition topic gets the copy of an event whose Kafka "
        "key is not its shopper id, keyed by it (runner.repartition): the partitioner of the producers "
        "that key correctly; librdkafka's default (confluent-kafka, kcat, shopper produce), "
        "murmur2_random for Java clients",
    )
    repartition_topic: str | None = Field(
        None,
        description="the topic the re-keyed copies go to and are read back from (runner.repartition): "
        "None = '{topic}.{group_id}.repartition'. Created at start with the event topic's partition "
        "count and replication where it does not exist; one with another partition count is refused",
    )
    kafka_max_poll_interval_ms: int = Field(
        60_000,
        ge=1000,
        description="a member that does not poll for this long leaves the group (librdkafka's "
        "max.poll.interval.ms; at least kafka_session_timeout_ms). The runner keeps polling, its "
        "partitions paused, while it waits for a store, so an outage does not reach it",
    )
    progress_interval_s: float = Field(2.0, gt=0)
    until_drained: bool = Field(False, description="exit when the topic is consumed and all results stored")
    drain_idle_s: float = Field(
        1.0, ge=0, description="with until_drained: quiet time that means 'caught up'"
    )
    revoke_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a rebalance waits this long for in-flight results before handing partitions over "
        "uncommitted (the next owner replays them; sinks are idempotent)",
    )
    unknown_topic_grace_s: float = Field(
        30.0,
        gt=0,
        description="a subscribed topic the broker still does not know this long after the consumer "
        "first reported it unknown stops the runner (runner.errors.ConsumerFailed); librdkafka can "
        "report a topic created moments before as unknown until its metadata reaches the client",
    )
    dlq_max_original_bytes: int = Field(
        DEFAULT_MAX_ORIGINAL_BYTES, ge=0, description="a dead letter keeps at most this much of the original"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve /metrics and /health here (runner.ops_server); None = off, 0 = a free port",
    )
    metrics_host: str = Field("127.0.0.1", description="0.0.0.0 in a container")
    log_format: LogFormat = Field("text", description="text, or json: one JSON object a line")
    sink_retry: SinkRetry = Field(default_factory=SinkRetry)
    session: SessionConfig = Field(default_factory=SessionConfig)
    llm: ClientConfig = Field(default_factory=ClientConfig)
    enrichment: EnrichmentSettings = Field(default_factory=EnrichmentSettings)
    sinks: SinkSettings = Field(default_factory=SinkSettings)

    @property
    def repartition_topic_name(self) -> str:
        """The repartition topic: ``repartition_topic``, or one named after the event topic and the
        group (each group re-keys into its own, so one group's copies are never read by another). A
        group id may hold characters a topic name may not (Kafka takes any in a group id, and the demo's
        holds the stack's ``:``): each becomes ``_``, and a digest of the whole id keeps two such
        groups apart."""
        if self.repartition_topic:
            return self.repartition_topic
        group = _NOT_IN_TOPIC_NAMES.sub("_", self.group_id)
        if group != self.group_id:
            group += "-" + hashlib.blake2b(self.group_id.encode(), digest_size=4).hexdigest()
        return f"{self.topic}.{group}.repartition"

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_setting(cls, data: Any) -> Any:
        refuse_settings_named_twice(os.environ, "RUNNER_", COMPONENT_PREFIXES)
        return data

    @model_validator(mode="after")
    def _superseded_calls_close(self) -> RunnerSettings:
        refuse_reading_on_superseded(self.llm, self.enrichment)
        return self


COMPONENT_PREFIXES = {"llm": "LLM_", "sinks": "SINK_"}
"""Nested settings that are also read from their own environment prefix."""
