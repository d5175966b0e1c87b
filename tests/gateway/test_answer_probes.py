"""The probe a quarantined replica must pass, built from a request the gateway forwarded (pure: the
probe's payload, no HTTP). Its decode budget is always capped: an uncapped probe of a slow replica ran
into its timeout, so a fixed replica stayed quarantined."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from llm_client.answer_probes import PROBE_MAX_TOKENS, ProbeRequest


def probe_of(fields: dict[str, Any]) -> dict[str, Any]:
    """The JSON a probe sends for a forwarded chat request with ``fields``."""
    forwarded = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    payload = ProbeRequest("/v1/chat/completions", forwarded, None).payload()
    assert payload is not None
    probe: dict[str, Any] = orjson.loads(payload)
    return probe


@pytest.mark.parametrize(
    ("fields", "budget"),
    [
        ({}, {"max_tokens": PROBE_MAX_TOKENS}),
        ({"max_tokens": 500.0}, {"max_tokens": PROBE_MAX_TOKENS}),
        ({"max_tokens": None}, {"max_tokens": PROBE_MAX_TOKENS}),
        (
            {"max_tokens": 500.0, "max_completion_tokens": 8},
            {"max_tokens": PROBE_MAX_TOKENS, "max_completion_tokens": 8},
        ),
        ({"min_tokens": 40}, {"max_tokens": 40}),
        ({"max_tokens": 500, "min_tokens": 40}, {"max_tokens": 40}),
        ({"max_tokens": 500, "min_tokens": 4}, {"max_tokens": PROBE_MAX_TOKENS}),
    ],
    ids=["none", "float", "null", "float-and-int", "min-tokens", "int-and-min-tokens", "small-min-tokens"],
)
def test_a_probe_from_a_request_without_an_int_budget_is_capped_too(
    fields: dict[str, Any], budget: dict[str, int]
) -> None:
    """Only an int ``max_tokens`` / ``max_completion_tokens`` was capped: a request without one (or with
    a float) was probed with no budget at all."""
    probe = probe_of({**fields, "stream": True, "stream_options": {"include_usage": True}})
    assert {k: probe[k] for k in ("max_tokens", "max_completion_tokens") if k in probe} == budget
    assert probe["stream"] is False and "stream_options" not in probe
    assert probe["model"] == "m", "the caller's own model name"


def test_a_request_nested_past_what_orjson_writes_gives_no_probe() -> None:
    """orjson reads 1,024 levels of nesting and writes 254: a forwarded request nested 300 deep, answered
    well and kept as the pool's known-good probe, made every probe raise before it was sent, so the
    quarantined replica was never probed while that request was the known-good one. It gives no probe
    now (``payload`` None), and the prober falls back to the next request it knows."""
    nested = b'{"model": "m", "messages": [], "extra": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert ProbeRequest("/v1/chat/completions", nested, None).payload() is None
