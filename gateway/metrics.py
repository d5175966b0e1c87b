"""Prometheus metrics of the gateway, in a registry of its own (no process-wide state).

Two kinds: what the gateway counts itself (requests by path and status, latency to the last byte, time
to the first byte of a stream, answers that broke off mid-stream), and what the LLM client already knows,
read at scrape time so it is never stale or double-counted (per-replica health, load and counters,
retries, requests in flight, the routing policy's decision counters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.idempotency import IdempotencyStore
from gateway.overload import PRIORITY_CLASS, Admission
from llm_client.client import LLMClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, client: LLMClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by path and HTTP status (the replica's, or the gateway's own error)",
            ["path", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gateway_request_duration_seconds",
            "From the request's arrival to the answer's last byte",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "gateway_time_to_first_byte_seconds",
            "From the request's arrival to the first body byte of a streamed answer (about the TTFT)",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "gateway_broken_answers",
            "Answers cut off after their first byte (the replica died or stalled mid-answer)",
            ["replica"],
            registry=self.registry,
        )
        self.superseded = Counter(
            "gateway_superseded",
            "Requests superseded by a newer version of their session before they were sent: on "
            "arrival (older than the session's newest) or while waiting for a slot (dropped from the queue)",
            ["stage"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "gateway_cancelled",
            "Requests superseded while in flight: their upstream request was closed",
            registry=self.registry,
        )
        self.refused = Counter(
            "gateway_refused",
            "Requests answered 429 by the gateway's admission, by priority and reason "
            "(predicted_wait, queue_full, pushed_out, waited)",
            ["priority", "reason"],
            registry=self.registry,
        )
        self.idempotent = Counter(
            "gateway_idempotent",
            "Requests with an Idempotency-Key answered without an upstream call of their own: joined "
            "(the call was in flight) or reused (its answer was kept)",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(ClientCollector(client))

    def watch(self, admission: Admission, store: IdempotencyStore) -> None:
        """Read the admission queue and the idempotency store at scrape time."""
        self.registry.register(OverloadCollector(admission, store))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class OverloadCollector(Collector):
    """The admission queue and the idempotency store, read at scrape time."""

    def __init__(self, admission: Admission, store: IdempotencyStore) -> None:
        self._admission = admission
        self._store = store

    def collect(self) -> Iterator[Metric]:
        admission, store = self._admission, self._store
        limit = GaugeMetricFamily("gateway_admission_limit", "Requests sent to the replicas at once, at most")
        limit.add_metric([], admission.limit)
        active = GaugeMetricFamily("gateway_admission_active", "Requests holding an admission slot")
        active.add_metric([], admission.gate.active)
        waiting = GaugeMetricFamily(
            "gateway_admission_waiting", "Requests waiting for a slot, by priority", labels=["priority"]
        )
        for priority in PRIORITY_CLASS:
            waiting.add_metric([priority], admission.waiting(priority))
        hold = GaugeMetricFamily(
            "gateway_admission_mean_hold_seconds",
            "Moving average of a slot's hold (the predicted wait's unit)",
        )
        hold.add_metric([], admission.mean_hold_s or 0.0)
        kept = GaugeMetricFamily(
            "gateway_idempotent_kept", "Answers kept for repeats of their Idempotency-Key"
        )
        kept.add_metric([], store.kept)
        kept_bytes = GaugeMetricFamily("gateway_idempotent_kept_bytes", "Bytes of the answers kept")
        kept_bytes.add_metric([], store.bytes_kept)
        flying = GaugeMetricFamily("gateway_idempotent_in_flight", "Calls in flight with an Idempotency-Key")
        flying.add_metric([], store.in_flight)
        yield from (limit, active, waiting, hold, kept, kept_bytes, flying)


class ClientCollector(Collector):
    """The LLM client's own state, read at scrape time."""

    def __init__(self, client: LLMClient) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        client = self._client
        in_flight = GaugeMetricFamily("gateway_in_flight", "Requests holding a replica slot or waiting")
        in_flight.add_metric([], client.in_flight)
        yield in_flight
        retries = CounterMetricFamily("gateway_retries", "Attempts made on another replica after a failure")
        retries.add_metric([], client.retries)
        yield retries
        routable = GaugeMetricFamily(
            "gateway_replica_routable",
            "1 when the replica takes traffic (healthy, not drained, not quarantined)",
            labels=["replica"],
        )
        outstanding = GaugeMetricFamily(
            "gateway_replica_outstanding", "Requests in flight on the replica", labels=["replica"]
        )
        served = CounterMetricFamily("gateway_replica_served", "Attempts answered", labels=["replica"])
        failed = CounterMetricFamily("gateway_replica_failed", "Attempts failed", labels=["replica"])
        refused = CounterMetricFamily(
            "gateway_replica_refused",
            "Attempts the replica refused for load (429): not failures",
            labels=["replica"],
        )
        ejections = CounterMetricFamily("gateway_replica_ejections", "Times ejected", labels=["replica"])
        state = GaugeMetricFamily(
            "gateway_replica_state",
            "1 for the replica's routing state: routable, ejected, drained, quarantined_<kind> (bad answers)",
            labels=["replica", "state"],
        )
        invalid = CounterMetricFamily(
            "gateway_replica_invalid_answers",
            "Answers that were no usable answer (too_large, wrong_shape, ...), by kind",
            labels=["replica", "kind"],
        )
        for endpoint in client.endpoints:
            label = [endpoint.name]
            routable.add_metric(label, 1.0 if endpoint.routable else 0.0)
            outstanding.add_metric(label, endpoint.outstanding)
            served.add_metric(label, endpoint.served)
            failed.add_metric(label, endpoint.failed)
            refused.add_metric(label, endpoint.refused)
            ejections.add_metric(label, endpoint.ejections)
            state.add_metric([endpoint.name, endpoint.routing_state], 1.0)
            for kind, count in sorted(endpoint.invalid_answers.items()):
                invalid.add_metric([endpoint.name, kind], float(count))
        yield from (routable, outstanding, served, failed, refused, ejections, state, invalid)
        yield from _policy_counters(client)
        yield from _group_weights(client)


def _group_weights(client: LLMClient) -> Iterator[Metric]:
    """Endpoint group weights and the spill state, when the policy has groups (``predicted_ttft``)."""
    weights = getattr(client.policy, "group_weights", None)
    if not callable(weights):
        return
    family = GaugeMetricFamily(
        "gateway_group_weight",
        "Traffic weight of an endpoint group (set live: PUT /admin/groups/...)",
        labels=["group"],
    )
    for group, weight in sorted(weights().items()):
        family.add_metric([group], weight)
    yield family
    spilling = GaugeMetricFamily("gateway_policy_spilling", "1 while the local group misses the TTFT SLO")
    spilling.add_metric([], 1.0 if getattr(client.policy, "spilling", False) else 0.0)
    yield spilling


def _policy_counters(client: LLMClient) -> Iterator[Metric]:
    """The policy's decision counters when it keeps any (``prefix_aware``'s ``stats``)."""
    stats = getattr(client.policy, "stats", None)
    if stats is None or not dataclasses.is_dataclass(stats):
        return
    for item in dataclasses.fields(stats):
        value = getattr(stats, item.name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            family = CounterMetricFamily(
                f"gateway_policy_{item.name}", f"Routing policy counter {item.name}", labels=["policy"]
            )
            family.add_metric([client.policy.name], float(value))
            yield family
