"""The Flink job's enrichment runner takes its settings from the job's (``devstack.enrichment_stage``):
what it reads, where it stores and which fleet it calls cannot drift from the job's, secrets included;
and the job's own async stage stays one setting away (``prompts_topic`` empty)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from devstack.enrichment_stage import enrichment_settings
from flink_jobs.flink_config import KafkaSettings, NearRealtimeSettings
from llm_client.config import ClientConfig
from pipeline.enrichment import EnrichmentSettings
from pipeline.kafka_security import KafkaSecurity
from pipeline.overload import OverloadSettings
from pipeline.sink_retry import SinkRetry
from pipeline.topics import PROMPTS_TOPIC
from prompt_assembly.errors import ConfigurationError
from sinks.config import SinkSettings


def test_the_job_hands_its_prompts_to_a_topic_by_default_and_empty_means_its_own_async_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert NearRealtimeSettings().prompts_topic == PROMPTS_TOPIC
    monkeypatch.setenv("FLINK_JOB_PROMPTS_TOPIC", "")
    job = NearRealtimeSettings.load()
    assert job.prompts_topic is None
    with pytest.raises(ConfigurationError, match="prompts_topic"):
        enrichment_settings(job)


def test_the_enrichment_runner_reads_stores_and_calls_as_the_job_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNNER_UNTIL_DRAINED", "true")  # the rest of RUNNER_* is the runner's own
    security = KafkaSecurity(
        protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password=SecretStr("p")
    )
    job = NearRealtimeSettings(
        kafka=KafkaSettings(
            bootstrap_servers="b-1.msk:9096",
            dlq_topic="dead",
            group_id="job-group",
            security=security,
            fetch_max_wait_ms=40,
        ),
        llm=ClientConfig(endpoints=["http://replica-a:8000", "http://replica-b:8000"], policy="prefix_aware"),
        sinks=SinkSettings(redis_url="rediss://cache:6379/0", redis_key_prefix="p:", s3_prefix="x"),
        prompts_topic="job-prompts",
        dlq_max_original_bytes=1234,
        enrichment=EnrichmentSettings(max_tokens=77, overload=OverloadSettings(policy="fifo")),
        sink_retry=SinkRetry(max_wait_s=9.0),
    )
    runner = enrichment_settings(job, metrics_port=0)
    assert (runner.input, runner.topic, runner.group_id) == ("prompts", "job-prompts", "job-group-enrich")
    assert (runner.bootstrap_servers, runner.dlq_topic, runner.dlq_max_original_bytes) == (
        "b-1.msk:9096",
        "dead",
        1234,
    )
    assert runner.kafka_security == security
    assert runner.kafka_fetch_wait_max_ms == 40, "the job's tuned fetch wait, for a broker that holds fetches"
    job.kafka.consumer_properties = {"fetch.max.wait.ms": "25"}  # wins over the field, as in the source
    assert enrichment_settings(job).kafka_fetch_wait_max_ms == 25
    assert runner.kafka_security.sasl_password is not None
    assert runner.kafka_security.sasl_password.get_secret_value() == "p"
    assert runner.llm == job.llm and runner.sinks == job.sinks and runner.enrichment == job.enrichment
    assert (runner.enrichment.max_tokens, runner.enrichment.overload.policy) == (77, "fifo")
    assert runner.sink_retry.max_wait_s == 9.0 and runner.metrics_port == 0
    assert not runner.until_drained, "a stage of a running job, never a batch that ends"
