"""One name per setting: a component field set both under the engine's nested name and under the
component's own prefix is refused, naming both variables and never a value; either alone works."""

from __future__ import annotations

import pytest

from flink_jobs.flink_config import NearRealtimeSettings
from prompt_assembly.errors import ConfigurationError
from runner.config import RunnerSettings
from shopper.cli import read_runner_settings


def test_either_name_alone_sets_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_MODEL", "own-name")
    monkeypatch.setenv("RUNNER_SINKS__S3_BUCKET", "nested-name")
    settings = RunnerSettings()
    assert settings.llm.model == "own-name" and settings.sinks.s3_bucket == "nested-name"


@pytest.mark.parametrize(
    ("nested", "own"),
    [
        ("RUNNER_LLM__MODEL", "LLM_MODEL"),
        ("runner_sinks__redis_key_prefix", "SINK_REDIS_KEY_PREFIX"),  # names are case-insensitive
        ("RUNNER_LLM__TIMEOUTS__ATTEMPT_S", "LLM_TIMEOUTS__ATTEMPT_S"),
    ],
)
def test_both_names_at_once_are_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, nested: str, own: str
) -> None:
    monkeypatch.setenv(nested, "secret-looking-1")
    monkeypatch.setenv(own, "secret-looking-2")
    with pytest.raises(ConfigurationError) as error:
        read_runner_settings()
    message = str(error.value)
    assert nested in message and own in message and "secret-looking" not in message


def test_the_flink_job_refuses_both_names_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLINK_JOB_SINKS__S3_BUCKET", "a")
    monkeypatch.setenv("SINK_S3_BUCKET", "b")
    with pytest.raises(ConfigurationError, match="FLINK_JOB_SINKS__S3_BUCKET and SINK_S3_BUCKET"):
        NearRealtimeSettings.load()


def test_the_json_form_of_a_nested_setting_counts_as_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_SINKS", '{"redis_key_prefix": "secret-looking-1"}')
    monkeypatch.setenv("SINK_REDIS_KEY_PREFIX", "secret-looking-2")
    with pytest.raises(ConfigurationError) as error:
        read_runner_settings()
    message = str(error.value)
    assert "RUNNER_SINKS.redis_key_prefix and SINK_REDIS_KEY_PREFIX" in message
    assert "secret-looking" not in message
    monkeypatch.delenv("SINK_REDIS_KEY_PREFIX")
    assert RunnerSettings().sinks.redis_key_prefix == "secret-looking-1", "alone, the JSON form works"
