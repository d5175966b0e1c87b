"""The real-time service's Prometheus metrics, in a registry of its own (several services can share a
process, as the tests and the benchmark do).

``realtime_process_cpu_seconds_total`` is the process's own CPU counter (``time.process_time``: user
plus system, every thread), read at scrape time: its increase over the increase of the request counters
is the CPU a request costs, measured where it is spent (``bench/realtime.py`` reports it). With several
services in one process it counts them all."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llm_client.cut_calls import CutCalls
from llm_client.endpoints import Endpoint

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0, 2.5)
"""Seconds; dense around the default 300 ms deadline."""

PROCESS_CPU = "realtime_process_cpu_seconds"


class _ProcessCpu(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            PROCESS_CPU, "CPU time of this process (user + system, all threads)", value=time.process_time()
        )


class _CutCalls(Collector):
    """``realtime_llm_cut_calls_total{outcome}``: model calls cut at their deadline that read on within
    the client's grace (``llm_client.cut_calls``): ``kept`` (answered within it, connection kept),
    ``closed`` (not, connection closed), ``failed``, and those closed at once (``closed_at_once``: recent
    cut calls had not finished within it); read at scrape time from the client's counters."""

    def __init__(self, cut_calls: CutCalls) -> None:
        self.cut_calls = cut_calls

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "realtime_llm_cut_calls",
            "model calls cut at their deadline and read on within the grace, by how they ended",
            labels=["outcome"],
        )
        c = self.cut_calls
        counts = (
            ("kept", c.kept),
            ("closed", c.closed),
            ("failed", c.failed),
            ("closed_at_once", c.closed_at_once),
        )
        for outcome, value in counts:
            family.add_metric([outcome], value)
        yield family


class _ReplicaStates(Collector):
    """``realtime_llm_endpoint_state{endpoint,state}``: 1 for each model replica's routing state
    (``Endpoint.routing_state``: routable, ejected, drained, quarantined_<kind>), as the runner and the
    gateway export it; read at scrape time from the client, whose replicas capacity shifting may change."""

    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]]) -> None:
        self.endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "realtime_llm_endpoint_state",
            "1 for a replica's routing state: routable, ejected, drained, quarantined_<kind> (bad answers)",
            labels=["endpoint", "state"],
        )
        for endpoint in self.endpoints():
            family.add_metric([endpoint.name, endpoint.routing_state], 1.0)
        yield family


class RealtimeMetrics:
    """Every series the service exports; ``rejected`` counts 4xx answers by error type
    (including ``unauthorized``, ``rate_limited`` and ``payload_too_large`` from the guards, and
    ``overloaded`` from deadline-aware admission)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("realtime_requests", "answered match requests", ["outcome"], registry=r)
        # Bound once: a label lookup per request is a lock and a dict probe for a constant answer.
        self.llm_answers = self.requests.labels("llm")
        self.degraded_answers = self.requests.labels("degraded")
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
        self.late_signal_reads = Gauge(
            "realtime_late_signal_reads",
            "signal reads given up on and left to finish (at most max_late_reads)",
            registry=r,
        )
        r.register(_ProcessCpu())

    def watch_cut_calls(self, cut_calls: CutCalls) -> None:
        """Export ``cut_calls``' counters (the service's model client)."""
        self.registry.register(_CutCalls(cut_calls))

    def watch_replicas(self, endpoints: Callable[[], Sequence[Endpoint]]) -> None:
        """Export the routing state of the replicas ``endpoints()`` lists (the model client's)."""
        self.registry.register(_ReplicaStates(endpoints))
