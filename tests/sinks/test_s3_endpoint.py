"""Where the S3 sink draws the line between a misconfigured endpoint and an outage.

An endpoint that is no URL is refused as the settings are read (``ConfigurationError``). One where
nothing answers at the sink's start (``open``) is an ``S3Unreachable`` naming the setting and the
endpoint, and the engines still retry it under their ``SinkRetry`` (an S3 starting beside them is waited
for, as before), so only the error they stop with changes. A flush's failure, an outage at run time,
stays botocore's own error on the same retry path."""

from __future__ import annotations

import contextlib

import pytest
from botocore.exceptions import EndpointConnectionError
from pydantic import ValidationError

from pipeline.checkpoint import Checkpoint
from pipeline.sink_retry import SinkRetry
from prompt_assembly.errors import ConfigurationError
from sinks.config import SinkSettings
from sinks.errors import S3Unreachable
from sinks.s3 import S3InsightSink
from tests.sinks.test_sinks import insight

REFUSED = "http://127.0.0.1:1"


@pytest.fixture(autouse=True)
def _one_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials of no one (botocore signs before it connects) and one attempt per call."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDS3ENDPOINT")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3-endpoint-not-a-secret")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")


@pytest.mark.parametrize("endpoint", ["not a url", "localhost:9000", "ftp://host", "http://host:port"])
def test_an_endpoint_that_is_no_url_is_refused_with_the_settings(endpoint: str) -> None:
    with pytest.raises(ValidationError) as raised:
        SinkSettings(s3_endpoint_url=endpoint)
    (cause,) = [e["ctx"]["error"] for e in raised.value.errors()]
    assert isinstance(cause, ConfigurationError) and repr(endpoint) in str(cause)


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com"])
def test_endpoints_that_can_work_are_taken(endpoint: str | None) -> None:
    assert SinkSettings(s3_endpoint_url=endpoint).s3_endpoint_url == endpoint


def test_an_empty_endpoint_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SINK_S3_ENDPOINT_URL=`` in an env file meant AWS's endpoint before endpoints were checked; it
    still does (and a stack's endpoint replaces it)."""
    monkeypatch.setenv("SINK_S3_ENDPOINT_URL", "")
    assert SinkSettings().s3_endpoint_url is None


async def test_an_endpoint_where_nothing_answers_at_the_start_is_named_and_still_retried() -> None:
    sink = S3InsightSink(SinkSettings(s3_endpoint_url=REFUSED, enabled=("s3",)))
    retried: list[BaseException] = []
    checkpoint = Checkpoint(
        [sink],
        SinkRetry(max_wait_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2),
        on_retry=lambda _what, exc: retried.append(exc),
    )
    try:
        with pytest.raises(S3Unreachable) as raised:
            await checkpoint.open()
    finally:
        await checkpoint.close()
    message = str(raised.value)
    assert "SINK_S3_ENDPOINT_URL" in message and f"no S3 answers at {REFUSED}" in message, message
    assert len(retried) >= 2 and all(isinstance(exc, S3Unreachable) for exc in retried), retried


async def test_an_outage_after_the_start_stays_botocores_error() -> None:
    sink = S3InsightSink(SinkSettings(s3_endpoint_url=REFUSED, enabled=("s3",)))
    try:
        await sink.write([insight("a", 1)])
        with pytest.raises(EndpointConnectionError):
            await sink.flush()
        assert sink.buffered == 1, "kept for the next flush"
    finally:
        with contextlib.suppress(EndpointConnectionError):  # its last flush fails too: still closed
            await sink.close()
