"""LLM client settings for the real-time (latency) pool."""

from __future__ import annotations

from llm_client.config import ClientConfig

CUT_GRACE_S = 0.25
"""How long a ranking call cut at its deadline reads on for its answer. trtllm-serve notices a gone
client at its next poll, about once a second, so a call that short is computed to its end either way;
its answer, a few hundred bytes, is read within this in nearly every case (docs/realtime.md)."""


def realtime_client_config(endpoints: list[str], model: str, **overrides: object) -> ClientConfig:
    """LLM client settings for a latency pool: no streaming (one write per answer), least outstanding
    requests, one quick retry elsewhere, no client-side queue (the service sheds instead), and a call
    cut at its deadline read on for ``CUT_GRACE_S`` so that its connection is kept
    (``llm_client.cut_calls``: the replica computes a call that short to its end anyway)."""
    options: dict[str, object] = {
        "endpoints": endpoints,
        "model": model,
        "policy": "least_outstanding",
        "stream": False,
        "max_in_flight": 1_000_000,
        "timeouts": {"connect_s": 0.5, "attempt_s": 5.0, "deadline_s": 5.0, "cut_grace_s": CUT_GRACE_S},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.002, "backoff_max_s": 0.01},
        "health": {"interval_s": 0.5, "eject_after_failures": 2},
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]
