"""Configuration of the near-real-time Flink job: one pydantic-settings model (env prefix ``FLINK_JOB_``,
nested with ``__``), optionally loaded from a YAML/JSON file given as ``--config``.

Every engine knob that changes throughput or guarantees is here, explicit and documented: checkpointing,
the RocksDB state backend, the restart strategy, Python bundle size/time, async capacity/timeout/retries.
The LLM client, enrichment, session and sink settings are the components' own models, nested.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llm_client.config import ClientConfig
from pipeline.dead_letter import DEFAULT_MAX_ORIGINAL_BYTES
from pipeline.enrichment import EnrichmentSettings, refuse_reading_on_superseded
from pipeline.kafka_security import KafkaSecurity, configuration_error
from pipeline.setting_names import refuse_settings_named_twice
from pipeline.sink_retry import SinkRetry
from pipeline.topics import DLQ_TOPIC, EVENTS_TOPIC, PROMPTS_TOPIC
from prompt_assembly.errors import ConfigurationError
from prompt_assembly.processor import SessionConfig
from sinks.config import SinkName, SinkSettings

FLINK_NATIVE_SINKS: frozenset[SinkName] = frozenset({"kafka"})
"""Enabled sinks the job writes with a Flink connector rather than from Python."""


class KafkaSettings(BaseModel):
    bootstrap_servers: str = "kafka:9092"
    events_topic: str = EVENTS_TOPIC
    dlq_topic: str = DLQ_TOPIC
    group_id: str = "shopper-understanding-flink"
    transactional_id_prefix: str | None = Field(
        None,
        description="prefix of the exactly-once Kafka sinks' transactional ids (the topic is appended); "
        "None: the group id. It must be unique per job on a cluster: a second job with the same prefix "
        "(a second environment, a resubmit beside the running one) fences the first job's producers, "
        "whose committed checkpoint then loses its insights (Flink logs ProducerFencedException)",
    )
    transaction_timeout_ms: int = Field(
        900_000,
        gt=0,
        description="must exceed the checkpoint interval plus the longest restart, and stay under the "
        "broker's transaction.max.timeout.ms (15 min by default)",
    )
    fetch_max_wait_ms: int = Field(
        100,
        gt=0,
        description="the source consumer's fetch.max.wait.ms (Kafka's default is 500). A broker that "
        "holds a fetch for this long instead of answering when data arrives (Tansu does) adds up to "
        "this much latency per record; on Kafka it only bounds the idle fetch rate",
    )
    consumer_properties: dict[str, str] = Field(
        default_factory=dict, description="more source consumer properties; they win over the fields above"
    )
    security: KafkaSecurity = Field(
        default_factory=KafkaSecurity,
        description="TLS/SASL of the source and sinks (pipeline.kafka_security.java_kafka_properties)",
    )

    def transactional_ids(self, topic: str) -> str:
        """The transactional-id prefix of the exactly-once sink to ``topic``: the job's own (by default
        its group id, which two jobs reading independently never share), then the topic. Until 6 Dec
        2026 the default was one constant for every job."""
        return f"{self.transactional_id_prefix or self.group_id}-{topic}"

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, data: Any) -> Any:
        if isinstance(data, dict) and "insights_topic" in data:
            raise ConfigurationError(
                "kafka.insights_topic is now sinks.insights_topic, written when sinks.enabled holds 'kafka' "
                "(one name for both engines)"
            )
        return data


class CheckpointSettings(BaseModel):
    interval_ms: int = Field(10_000, gt=0)
    mode: Literal["exactly_once", "at_least_once"] = "exactly_once"
    timeout_ms: int = Field(120_000, gt=0)
    min_pause_ms: int = Field(2_000, ge=0)
    directory: str = Field("file:///tmp/flink-checkpoints", description="s3://... on a cluster")
    state_backend: Literal["rocksdb", "hashmap"] = "rocksdb"
    incremental: bool = True


class RestartSettings(BaseModel):
    strategy: Literal["exponential-delay", "fixed-delay", "none"] = "exponential-delay"
    attempts: int = Field(10, ge=1, description="fixed-delay only")
    initial_delay_ms: int = Field(1_000, gt=0)
    max_delay_ms: int = Field(60_000, gt=0)


class AsyncSettings(BaseModel):
    """Knobs of the two Python async stages; the measurements behind the defaults are in docs/flink.md.

    PyFlink's async operator starts one ``threading.Timer`` (an OS thread) per in-flight record when it
    has a timeout or a retry strategy; that, not the LLM, caps a worker at ~1k records/s here. So the
    timeout is enforced on the event loop (``asyncio.timeout``) and Flink-level retries are off unless
    ``retry_attempts`` > 0 (the client already retries across replicas under its retry budget).
    """

    capacity: int = Field(512, ge=1, description="in-flight LLM calls per subtask (rate x latency / 0.8)")
    timeout_ms: int = Field(
        60_000, gt=0, description="per prompt; past it the prompt's result is a FlinkAsyncTimeout error"
    )
    retry_attempts: int = Field(
        0,
        ge=0,
        description="Flink-level re-invocations of NoHealthyEndpoint results; costs a thread per call",
    )
    retry_backoff_ms: int = Field(500, gt=0)
    bundle_size: int = Field(100_000, ge=1, description="python.fn-execution.bundle.size")
    bundle_time_ms: int = Field(
        250,
        ge=1,
        description="python.fn-execution.bundle.time: a process-mode Python stage holds its input for up "
        "to twice this (docs/flink.md, 'Latency'); 250 ms keeps >= 0.8 of the async ceiling at 1 s calls",
    )
    sink_capacity: int = Field(2048, ge=1, description="results in flight in the Redis/S3 sink step")
    sink_timeout_ms: int = Field(120_000, gt=0, description="a sink write slower than this fails the job")
    sink_idle_flush_ms: int = Field(
        20, ge=1, description="the sink commits to S3 once no result arrived for this long (a bundle end)"
    )
    close_timeout_ms: int = Field(
        5_000,
        gt=0,
        description="how long an async stage may take to close its clients (LLM, Redis, S3) when its "
        "task ends or restarts; a store that is down does not hold a restart longer than this",
    )


class NearRealtimeSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FLINK_JOB_", env_nested_delimiter="__", hide_input_in_errors=True
    )

    job_name: str = "shopper-understanding-near-realtime"
    parallelism: int = Field(1, ge=1)
    max_parallelism: int = Field(
        128,
        ge=1,
        le=32768,
        description="key groups: the most subtasks the keyed state can ever be split over. Fixed for "
        "the life of the state (a savepoint restores only at the same value), so set it once, well "
        "above any parallelism planned (docs/flink.md, 'Rescaling'); 128 is also Flink's own default "
        "for jobs below parallelism 86, so savepoints taken without it still restore",
    )
    python_executable: str | None = Field(None, description="worker python; None = this interpreter locally")
    state_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="a quiet shopper's session is dropped")
    max_lateness_for_timer_s: float = Field(
        0.0, ge=0, description="extra wall time before a pending trigger's processing-time timer fires"
    )
    wall_clock_timers: bool = Field(
        True,
        description="pending triggers fire on processing-time timers (a live shopper's pause); off: they "
        "fire only from event time or at a drain, so prompts depend only on each shopper's event order",
    )
    flush_on_drain: bool = Field(
        False,
        description="keep an event-time timer at Long.MAX_VALUE per pending trigger so that `flink stop "
        "--drain` (or the end of a bounded input) fires every pending trigger",
    )
    buffer_timeout_ms: int = Field(
        10,
        ge=0,
        description="execution.buffer-timeout.interval: how long a network buffer between tasks (the "
        "source -> keyed sessions exchange) waits to fill before it is sent (Flink's default 100 ms); "
        "0 flushes after every record",
    )
    session_stage_mode: Literal["thread", "process"] = Field(
        "thread",
        description="python.execution-mode of the keyed session stage alone: 'thread' runs it in the "
        "TaskManager's JVM (PEMJA), record by record, so it holds nothing for a bundle; the async stage "
        "always runs in 'process' mode (PyFlink has no async function in thread mode)",
    )
    python_path: str | None = Field(
        None,
        description="python.pythonpath for 'thread' mode: where the TaskManager's embedded interpreter "
        "finds the job's packages; None = the submitting interpreter's site-packages and the project root",
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    restart: RestartSettings = Field(default_factory=RestartSettings)
    async_io: AsyncSettings = Field(default_factory=AsyncSettings)
    llm: ClientConfig = Field(default_factory=ClientConfig)
    enrichment: EnrichmentSettings = Field(default_factory=EnrichmentSettings)
    session: SessionConfig = Field(default_factory=SessionConfig)
    dlq_max_original_bytes: int = Field(
        DEFAULT_MAX_ORIGINAL_BYTES, ge=0, description="a dead letter keeps at most this much of the original"
    )
    sinks: SinkSettings = Field(
        default_factory=SinkSettings,
        description="sinks.enabled as in the runner; 'kafka' is the connector's transactional KafkaSink "
        "on sinks.insights_topic, the others are written from the async stage; () = none (benchmarks)",
    )
    sink_retry: SinkRetry = Field(default_factory=SinkRetry, description="the runner's policy, shared")
    prompts_topic: str | None = Field(
        PROMPTS_TOPIC,
        description="end the job at its session stage: each prompt goes, keyed by shopper id, to this topic "
        "(at least once, as it is made), and a runner with input 'prompts' on it enriches and stores "
        "(latest wins, the gate and the answer ledger, with no Beam bundle on the call's path; "
        "docs/flink.md, 'Prompts topic'). None or empty (FLINK_JOB_PROMPTS_TOPIC=''): the job's own "
        "async stage enriches, one deployable, and the insights topic exactly once",
    )

    @field_validator("prompts_topic", mode="before")
    @classmethod
    def _empty_is_the_async_stage(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_setting(cls, data: Any) -> Any:
        refuse_settings_named_twice(os.environ, "FLINK_JOB_", {"llm": "LLM_", "sinks": "SINK_"})
        return data

    @model_validator(mode="after")
    def _superseded_calls_close(self) -> NearRealtimeSettings:
        refuse_reading_on_superseded(self.llm, self.enrichment)
        return self

    @model_validator(mode="after")
    def _parallelism_within_key_groups(self) -> NearRealtimeSettings:
        if self.parallelism > self.max_parallelism:
            raise ConfigurationError(
                f"parallelism {self.parallelism} exceeds max_parallelism {self.max_parallelism}"
            )
        return self

    @property
    def result_sinks(self) -> tuple[SinkName, ...]:
        """The sinks the async stage writes (``sinks.registry``): every enabled one except 'kafka',
        which is Flink's own exactly-once ``KafkaSink`` (``insights_topic``)."""
        return tuple(name for name in self.sinks.enabled if name not in FLINK_NATIVE_SINKS)

    @property
    def insights_topic(self) -> str | None:
        """The results topic of the connector's ``KafkaSink``; None when 'kafka' is not enabled."""
        return self.sinks.insights_topic if "kafka" in self.sinks.enabled else None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> NearRealtimeSettings:
        """Defaults < environment < file < ``overrides``. Settings that cannot work raise
        ``ConfigurationError`` (``InsecureConfiguration`` for a secret on a plaintext Kafka protocol)
        naming each setting, never its value."""
        data: dict[str, Any] = {}
        if path is not None:
            text = Path(path).read_text()
            if str(path).endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                data = orjson.loads(text)
        data.update(overrides)
        try:
            return cls(**data)
        except ValidationError as error:
            raise configuration_error(error, "the Flink job's settings (FLINK_JOB_*, --config)") from None

    def to_json(self) -> str:
        """What every Python function receives (pickled functions carry this string, not objects).
        Secrets are written in clear so that workers can use them: prefer leaving credentials unset
        here and giving the task managers the AWS default credential chain."""
        return orjson.dumps(self.model_dump(), default=_plain).decode()

    @classmethod
    def from_json(cls, raw: str) -> NearRealtimeSettings:
        return cls.model_validate_json(raw)


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
