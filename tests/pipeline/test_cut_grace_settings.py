"""A cut grace is the real-time path's (``llm_client.cut_calls``): on a stream engine it would keep a
superseded prompt's call reading, holding the replica slot that latest wins closes the call to free for
the shopper's newer prompt. Both engines refuse it at start, naming the setting; where no call is
cancelled for a newer prompt (``cancel_in_flight`` off) it is taken."""

from __future__ import annotations

import pytest

from flink_jobs.flink_config import NearRealtimeSettings
from prompt_assembly.errors import ConfigurationError
from shopper.cli import read_runner_settings


def test_both_stream_engines_refuse_a_cut_grace_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_TIMEOUTS__CUT_GRACE_S", "0.25")
    with pytest.raises(ConfigurationError, match=r"cut_grace_s is 0\.25 s"):
        read_runner_settings()
    with pytest.raises(ConfigurationError, match="cancel_in_flight"):
        NearRealtimeSettings.load()


def test_a_cut_grace_is_taken_where_no_call_is_cancelled_for_a_newer_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLM_TIMEOUTS__CUT_GRACE_S", "0.25")
    monkeypatch.setenv("RUNNER_ENRICHMENT__OVERLOAD__CANCEL_IN_FLIGHT", "false")
    monkeypatch.setenv("FLINK_JOB_ENRICHMENT__OVERLOAD__POLICY", "fifo")
    assert read_runner_settings().llm.timeouts.cut_grace_s == 0.25
    assert NearRealtimeSettings.load().llm.timeouts.cut_grace_s == 0.25
