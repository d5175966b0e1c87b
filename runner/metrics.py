"""Prometheus metrics of the embedded runner, read from its own state at scrape time.

Names follow the Flink job's metric group ``shopper`` (``flink_jobs.flink_functions``) wherever they
mean the same, so one dashboard query reads either engine: the runner exports ``shopper_events_in_total``
where Flink's Prometheus reporter exports ``flink_taskmanager_job_task_operator_shopper_events_in``.
Where Flink publishes a quantile gauge (``llm_latency_p99_ms``: PyFlink has no histogram that survives
its threading), the runner exports a real histogram (``shopper_llm_latency_seconds``) instead.

Counters and gauges are not incremented along the hot path: a collector reads ``RunnerStats``, the
dead-letter counts, the consumer's cached watermarks and the LLM client when Prometheus scrapes. Only
the three histograms are observed per result. Every label set is bounded: ``reason`` is one of
``runner.dead_letters.REASON_CATEGORIES``, ``partition`` is one of the topic's partitions, ``endpoint``
one of the configured replicas. Each runner has its own registry (no process-global state), so tests
and several runners in one process never share series.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_client.routing.pd_aware import PdAwarePolicy
from prompt_assembly.records import EnrichmentResult, ShopperInsight
from runner.dead_letters import REASON_CATEGORIES
from runner.health import RunnerView, readiness

PREFIX = "shopper"
LLM_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
FRESHNESS_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)


class RunnerMetrics:
    def __init__(self, view: RunnerView) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.llm_latency = Histogram(
            f"{PREFIX}_llm_latency_seconds",
            "LLM call latency of stored insights (request sent -> last token), retries included",
            buckets=LLM_BUCKETS_S,
            registry=self.registry,
        )
        self.llm_ttft = Histogram(
            f"{PREFIX}_llm_ttft_seconds",
            "LLM time to first token of stored insights",
            buckets=LLM_BUCKETS_S,
            registry=self.registry,
        )
        self.freshness = Histogram(
            f"{PREFIX}_freshness_seconds",
            "Kafka timestamp of the triggering event -> its result stored in Redis",
            buckets=FRESHNESS_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(view))

    def observe_result(self, result: EnrichmentResult, freshness_ms: float | None) -> None:
        if isinstance(result, ShopperInsight) and not result.replayed:  # one observation per model call
            self.llm_latency.observe(result.latency_ms / 1000)
            self.llm_ttft.observe(result.ttft_ms / 1000)
        if freshness_ms is not None:
            self.freshness.observe(freshness_ms / 1000)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, as ``/metrics`` serves it."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, view: RunnerView) -> None:
        self.view = view

    def describe(self) -> list[Metric]:
        return []  # families are known only at collect time (labels depend on the assignment)

    def collect(self) -> Iterator[Metric]:
        view = self.view
        stats, acct, dead = view.stats, view.stats.accounting, view.stats.dead_letters

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield counter(
            "events_in", "Records consumed (the event topic and the repartition topic)", acct.consumed
        )
        yield counter("events_valid", "Records that passed the gate", acct.consumed - acct.dead_lettered)
        dlq = CounterMetricFamily(
            f"{PREFIX}_events_dlq", "Records dead-lettered, by reason category", labels=["reason"]
        )
        for reason in REASON_CATEGORIES:
            dlq.add_metric([reason], dead.by_reason.get(reason, 0))
        yield dlq
        yield counter(
            "events_rekeyed",
            "Records whose Kafka key was not their shopper id, produced to the repartition topic keyed by it",
            acct.rekeyed,
        )
        yield counter("events_accepted", "Events applied to a session", acct.accepted)
        yield counter(
            "session_resets",
            "Answers that replaced another session's signal: the shopper's session state was lost",
            view.session_resets(),
        )
        yield counter(
            "results_too_large",
            "Results not written to the results topic, over a Kafka size limit (Redis and S3 hold them)",
            view.results_too_large(),
        )
        yield counter("events_duplicate", "Events dropped as duplicates", acct.duplicates)
        yield counter("prompts_emitted", "Prompt requests launched", acct.prompts)
        yield counter(
            "events_trimmed_unprompted",
            "Accepted events the session's token or event budget trimmed before any prompt took them "
            "(named in the next result's trimmed_event_ids)",
            acct.trimmed_unprompted,
        )
        yield counter("results_written", "Results stored (insights and errors)", acct.insights + acct.errors)
        yield counter("insights_written", "Insights stored", acct.insights)
        yield counter("errors_written", "Error records stored", acct.errors)
        yield counter(
            "superseded_written",
            "Superseded records stored (a newer prompt won, or a browse pause went stale); "
            "not in results_written",
            acct.superseded,
        )
        yield counter("llm_prompt_tokens", "Prompt tokens the replicas reported", stats.prompt_tokens)
        yield counter("llm_cached_tokens", "Prompt tokens served from the KV cache", stats.cached_tokens)
        yield gauge("llm_cache_hit_ratio", "Cached / prompt tokens since start", stats.cache_hit_ratio)
        yield gauge("prompts_in_flight", "Prompts waiting for the LLM or for their store", view.in_flight)
        yield gauge(
            "events_unaccounted",
            "Consumed events not yet dead-lettered, applied or dropped (0 between polls)",
            acct.events_unaccounted,
        )
        yield gauge(
            "prompts_unaccounted",
            "Prompts without a stored result yet (the in-flight ones; grows only while a store is down)",
            acct.prompts_unaccounted,
        )
        yield counter("commits", "Offset commits (each after everything before it is durable)", stats.commits)
        last = stats.last_commit_at if stats.last_commit_at is not None else view.started_at
        yield gauge(
            "last_commit_age_seconds",
            "Seconds since the runner was last up to date: its last offset commit, or a durable point "
            "that found nothing left to commit (since start before either)",
            time.monotonic() - last,
        )
        yield counter("sink_retries", "Redis / S3 / session-store writes retried", stats.sink_retries)
        yield counter(
            "sessions_salvaged",
            "Stored sessions loaded with what this code could not read left out (or started over)",
            stats.sessions_salvaged,
        )
        yield counter(
            "session_entries_unreadable",
            "Stored session log entries left out as unreadable by those loads",
            stats.session_entries_unreadable,
        )
        yield counter(
            "fenced_saves",
            "Session saves refused: a newer owner had taken their partitions (dropped; replayed there)",
            stats.fenced_saves,
        )
        yield counter("dead_letters_delivered", "Dead letters on the DLQ", dead.delivered)
        yield counter(
            "dead_letters_shrunk", "Dead letters sent without their original (DLQ size limit)", dead.shrunk
        )
        yield counter(
            "dead_letters_undelivered", "Dead letters that could not be produced (logged)", dead.undelivered
        )
        yield counter("backpressure_pauses", "Times the partitions were paused", stats.paused_times)
        yield counter(
            "long_wait_pauses",
            "Times the partitions were paused to poll on while a wait outlasted a second: for the "
            "session store (an outage, or a store too slow for its load), or a shutdown's drain",
            stats.long_wait_pauses,
        )
        yield gauge("backpressure_paused", "1 while the partitions are paused", float(view.paused))
        assigned = view.assigned_partitions()
        yield gauge("partitions_assigned", "Partitions this member owns", len(assigned))
        lag = GaugeMetricFamily(
            f"{PREFIX}_consumer_lag", "Records behind the high watermark, per partition", labels=["partition"]
        )
        for partition, behind in sorted(view.lag_by_partition().items()):
            lag.add_metric([str(partition)], behind)
        yield lag
        client = view.llm_client
        yield gauge("llm_in_flight", "LLM calls in flight", 0 if client is None else client.in_flight)
        yield counter(
            "llm_client_retries", "LLM attempts retried on a replica", 0 if client is None else client.retries
        )
        enrichment = view.enrichment
        if enrichment is not None:
            not_sent = CounterMetricFamily(
                f"{PREFIX}_prompts_not_sent",
                "Prompts answered without a model call of their own, by cause (docs/overload.md): "
                "superseded_queued, cancelled_in_flight, dropped_stale, skipped_answered, joined, "
                "superseded_upstream, superseded_answered",
                labels=["cause"],
            )
            for cause, count in enrichment.counts.as_dict().items():
                not_sent.add_metric([cause], count)
            yield not_sent
            ledger = enrichment.ledger
            if ledger is not None:
                ledger_ops = CounterMetricFamily(
                    f"{PREFIX}_answer_ledger",
                    "The answer ledger (pipeline.answer_ledger.LedgerCounts): answers recorded and found, "
                    "answers found for other events, and read and write failures (each failure is a "
                    "prompt that may be paid for twice after a crash)",
                    labels=["op"],
                )
                counts = ledger.counts
                for op in ("recorded", "found", "other_events", "read_failures", "write_failures"):
                    ledger_ops.add_metric([op], getattr(counts, op))
                yield ledger_ops
            yield gauge("admission_active", "Prompts admitted to the fleet now", enrichment.gate.active)
            yield gauge("admission_waiting", "Prompts waiting for admission now", enrichment.gate.waiting)
            yield gauge("admission_limit", "Prompts the gate admits at once now", enrichment.gate.limit)
            yield counter(
                "admission_newest_first",
                "Prompts admitted ahead of older ones of their class: the class had a standing queue",
                enrichment.gate.admitted_newest_first,
            )
            yield counter(
                "admission_backfilled",
                "Prompts that waited past their class's budget and went behind every fresher prompt "
                "(OverloadSettings.max_backfill); answered once there is room, unless dropped as stale",
                enrichment.gate.backfilled,
            )
            tokens = CounterMetricFamily(
                f"{PREFIX}_llm_tokens",
                "Tokens of prompts sent, by whether their answer landed and by phase (prefill: uncached "
                "prompt tokens; not_landed: cancelled in flight or failed, an estimate, see "
                "pipeline.overload.TokenCounts)",
                labels=["answer", "phase"],
            )
            for name, value in enrichment.tokens.as_dict().items():
                answer, _, phase = name.rpartition("_")
                tokens.add_metric([answer, phase], value)
            yield tokens
            yield gauge(
                "llm_tokens_not_landed_ratio",
                "Share of the tokens sent (prefill and decode) spent on prompts whose answer never landed",
                enrichment.tokens.not_landed_share,
            )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_llm_endpoint_healthy", "1 while a replica is routable", labels=["endpoint"]
        )
        state = GaugeMetricFamily(
            f"{PREFIX}_llm_endpoint_state",
            "1 for a replica's routing state: routable, ejected, drained, quarantined_<kind> (bad answers)",
            labels=["endpoint", "state"],
        )
        invalid = CounterMetricFamily(
            f"{PREFIX}_llm_invalid_answers",
            "Answers that were no usable answer (too_large, not_json, wrong_shape, empty, schema)",
            labels=["endpoint", "kind"],
        )
        for endpoint in [] if client is None else client.endpoints:
            healthy.add_metric([endpoint.name], float(endpoint.routable))
            state.add_metric([endpoint.name, endpoint.routing_state], 1.0)
            for kind, count in sorted(endpoint.invalid_answers.items()):
                invalid.add_metric([endpoint.name, kind], float(count))
        yield healthy
        yield state
        yield invalid
        policy = None if client is None else client.policy
        if isinstance(policy, PdAwarePolicy):
            prefills = CounterMetricFamily(
                f"{PREFIX}_llm_prefills",
                "P/D: where each request's prefill went: remote (a context server), local_small, "
                "local_share, local_busy, local_no_context (on the decode server), redone_locally",
                labels=["where"],
            )
            for where, count in sorted(asdict(policy.stats).items()):
                prefills.add_metric([where], float(count))
            yield prefills
        yield gauge("runner_ready", "1 while /health/ready answers 200", float(readiness(view).ready))
