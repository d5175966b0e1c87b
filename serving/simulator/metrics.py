"""Prometheus metrics of one replica, in a registry of its own.

Several replicas share a process in tests, so nothing may go to prometheus_client's global registry.
Latency histograms are in *simulated* seconds (wall seconds divided by ``time_scale``), so dashboards read
the same at any speed-up; with ``time_scale`` 0 they hold wall seconds.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0)


class ReplicaMetrics:
    """Counters and gauges named ``sim_*``; gauges read the engine at scrape time."""

    def __init__(
        self,
        replica_id: str,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_blocks_used: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("sim_replica", "Identity of this simulated replica", registry=r).info(
            {"replica_id": replica_id, "model": model_name}
        )
        self.requests = Counter("sim_requests", "Generation requests received", ["endpoint"], registry=r)
        self.errors = Counter("sim_request_errors", "Requests answered with an error", ["reason"], registry=r)
        self.prompt_tokens = Counter("sim_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "sim_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.completion_tokens = Counter("sim_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "sim_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "sim_request_queue_time_seconds",
            "Time waiting for admission",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sim_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        Gauge("sim_num_requests_running", "Requests in the running batch", registry=r).set_function(running)
        Gauge("sim_num_requests_waiting", "Requests waiting for admission", registry=r).set_function(waiting)
        Gauge("sim_kv_cache_blocks_used", "Reusable KV blocks held", registry=r).set_function(kv_blocks_used)

    def render(self) -> bytes:
        return generate_latest(self.registry)
