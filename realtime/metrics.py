"""The real-time service's Prometheus metrics, in a registry of its own (several services can share a
process, as the tests and the benchmark do)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0, 2.5)
"""Seconds; dense around the default 300 ms deadline."""


class RealtimeMetrics:
    """Every series the service exports; ``rejected`` counts 4xx answers by error type (including
    ``unauthorized``, ``rate_limited`` and ``payload_too_large`` from the guards)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("realtime_requests", "answered match requests", ["outcome"], registry=r)
        self.degraded = Counter("realtime_degraded", "fallback answers by reason", ["reason"], registry=r)
        self.rejected = Counter("realtime_rejected", "4xx answers by error type", ["type"], registry=r)
        self.elapsed = Histogram(
            "realtime_request_seconds", "arrival to answer", buckets=LATENCY_BUCKETS, registry=r
        )
        self.llm = Histogram(
            "realtime_llm_seconds", "waiting for the model", buckets=LATENCY_BUCKETS, registry=r
        )
        self.overhead = Histogram(
            "realtime_overhead_seconds",
            "answer time not spent waiting for the model",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=r,
        )
        self.llm_in_flight = Gauge("realtime_llm_in_flight", "model calls in flight", registry=r)
        self.signal_errors = Counter(
            "realtime_signal_errors", "Redis reads that failed or timed out", registry=r
        )
