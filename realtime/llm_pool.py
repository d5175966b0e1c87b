"""LLM client settings for the real-time (latency) pool."""

from __future__ import annotations

from llm_client.config import ClientConfig


def realtime_client_config(endpoints: list[str], model: str, **overrides: object) -> ClientConfig:
    """LLM client settings for a latency pool: no streaming (one write per answer), least outstanding
    requests, one quick retry elsewhere, no client-side queue (the service sheds instead)."""
    options: dict[str, object] = {
        "endpoints": endpoints,
        "model": model,
        "policy": "least_outstanding",
        "stream": False,
        "max_in_flight": 1_000_000,
        "timeouts": {"connect_s": 0.5, "attempt_s": 5.0, "deadline_s": 5.0},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.002, "backoff_max_s": 0.01},
        "health": {"interval_s": 0.5, "eject_after_failures": 2},
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]
