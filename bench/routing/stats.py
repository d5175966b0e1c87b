"""What a replay measured: per-request outcomes, run summaries, tails, recovery windows, and the
bootstrap aggregates across repeats."""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.trace import (
    OracleBound,
    TraceRequest,
)
from llm_client import LLMClient


# ---- one replay ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    shopper: str
    arrival_s: float
    done_s: float
    ok: bool
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    endpoint: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    attempts: int = 0
    error: str = ""


@dataclass
class RunResult:
    setup: str
    policy: str
    utilisation: float
    requests: int
    completed: int
    lost: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    server_ttft_mean_ms: float | None
    """The replicas' own mean TTFT: without the client's tokenising/hashing and HTTP overhead."""
    e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    prefill_tokens: int
    prefill_tokens_sim: int | None
    prompt_tokens: int
    cache_hit_ratio: float
    load_max_over_mean: float
    busy_max_over_mean: float | None
    retries: int
    drains: int
    restarts_detected: int
    oracle_prefill_tokens: int
    oracle_prefill_tokens_per_shopper: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    server_ttft_p50_ms: float | None = None
    server_ttft_p99_ms: float | None = None
    """Exact, from every request's TTFT as the replicas measured it: the router's effect without the
    client process's own CPU delays (which dominate client-side tails on a loaded 2-core machine)."""


def summarise(
    setup: str,
    policy: str,
    utilisation: float,
    outcomes: Sequence[Outcome],
    client: LLMClient,
    oracle: OracleBound,
    stats: Sequence[dict[str, Any] | None] | None,
    wall_s: float,
    server_ttft: float | None = None,
) -> RunResult:
    ok = [o for o in outcomes if o.ok]
    ttft = sorted(o.ttft_ms for o in ok)
    e2e = sorted(o.e2e_ms for o in ok)
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    per_replica = Counter(o.endpoint for o in ok)
    loads = [per_replica.get(e.name, 0) for e in client.endpoints]
    span = max(o.done_s for o in ok) - min(o.arrival_s for o in outcomes) if ok else 0.0
    sim_prefill = busy_ratio = None
    if stats and all(s is not None for s in stats):
        engines = [s["engine"] for s in stats if s is not None]
        sim_prefill = sum(int(e["prefill_tokens_computed"]) for e in engines)
        busy = [float(e["busy_ms"]) for e in engines]
        busy_ratio = max(busy) / statistics.mean(busy) if statistics.mean(busy) > 0 else None
    return RunResult(
        setup=setup,
        policy=policy,
        utilisation=utilisation,
        requests=len(outcomes),
        completed=len(ok),
        lost=len(outcomes) - len(ok),
        ttft_mean_ms=statistics.fmean(ttft) if ttft else 0.0,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        server_ttft_mean_ms=server_ttft,
        e2e_mean_ms=statistics.fmean(e2e) if e2e else 0.0,
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        prefill_tokens=prompt - cached,
        prefill_tokens_sim=sim_prefill,
        prompt_tokens=prompt,
        cache_hit_ratio=cached / prompt if prompt else 0.0,
        load_max_over_mean=max(loads) / statistics.mean(loads) if loads and statistics.mean(loads) else 0.0,
        busy_max_over_mean=busy_ratio,
        retries=client.retries,
        drains=client.degradation.drains,
        restarts_detected=sum(e.restarts_detected for e in client.endpoints),
        oracle_prefill_tokens=oracle.prefill_tokens_global,
        oracle_prefill_tokens_per_shopper=oracle.prefill_tokens_per_shopper,
        wall_s=wall_s,
    )


def _pct(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def _after_reset(outcomes: Sequence[Outcome], reset_s: float, victim: str) -> dict[str, Any]:
    """What the reset cost: requests sent to the reset replica in the 20 simulated seconds after it,
    and how many of them found less than the shared head cached (routed on a belief the reset made
    stale)."""
    after = [o for o in outcomes if o.ok and o.endpoint == victim and reset_s <= o.arrival_s < reset_s + 20]
    cold = [o for o in after if o.cached_tokens < 0.3 * o.prompt_tokens]
    return {
        "requests_to_victim_20s": len(after),
        "cold_on_victim_20s": len(cold),
        "prefill_tokens_after_reset": sum(
            o.prompt_tokens - o.cached_tokens for o in outcomes if o.ok and o.arrival_s >= reset_s
        ),
    }


def tail_report(outcomes: Sequence[Outcome], timed: Sequence[TraceRequest]) -> dict[str, Any]:
    """Who is in the slowest 1% of TTFT: cold prompts (less than 30% cached), the busiest shopper's
    prompts, and how they spread over replicas; what moved the tail is read from this."""
    ok = sorted((o for o in outcomes if o.ok), key=lambda o: o.ttft_ms)
    if not ok:
        return {}
    top = ok[-max(1, len(ok) // 100) :]
    busiest = Counter(r.shopper_id for r in timed).most_common(2)
    hot = {s for s, _ in busiest}
    return {
        "p99_set": len(top),
        "cold": sum(o.cached_tokens < 0.3 * o.prompt_tokens for o in top),
        "hot_shopper": sum(o.shopper in hot for o in top),
        "replicas": dict(Counter(o.endpoint for o in top)),
        "retried": sum(o.attempts > 1 for o in top),
        "cold_share_all": sum(o.cached_tokens < 0.3 * o.prompt_tokens for o in ok) / len(ok),
    }


def server_tail_report(first_tokens: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the slowest 1% of first tokens waited for, as the replicas saw it: the queue (iterations
    already running or ahead of them) or the iteration that prefilled them (their own prompt and any
    other prefilled with it), against the same for every request."""
    ranked = sorted(first_tokens, key=lambda r: float(r["ttft_ms"]))
    if not ranked:
        return {}
    top = ranked[-max(1, len(ranked) // 100) :]

    def shape(records: Sequence[dict[str, Any]]) -> dict[str, float]:
        n = len(records)
        return {
            "ttft_ms": sum(float(r["ttft_ms"]) for r in records) / n,
            "queue_ms": sum(float(r["queue_ms"]) for r in records) / n,
            "cold_share": sum(r["cached_tokens"] < 0.3 * r["prompt_tokens"] for r in records) / n,
            "own_new_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in records) / n,
            "batch_prefill_tokens": sum(r["batch_prefill_tokens"] for r in records) / n,
            "batch_running": sum(r["batch_running"] for r in records) / n,
        }

    return {
        "p99_set": shape(top),
        "all": shape(ranked),
        "p99_replicas": dict(Counter(int(r["replica"]) for r in top)),
        "p99_requests": [dict(r) for r in top],
    }


WINDOW_S = 10.0


def windows(outcomes: Sequence[Outcome]) -> list[tuple[float, float, float]]:
    """(start, mean TTFT ms, cache-hit ratio) of the requests arriving in each 10 s simulated window."""
    ok = [o for o in outcomes if o.ok]
    end = max((o.arrival_s for o in ok), default=0.0)
    out: list[tuple[float, float, float]] = []
    t = 0.0
    while t <= end:
        sample = [o for o in ok if t <= o.arrival_s < t + WINDOW_S]
        if sample:
            ttft = statistics.fmean(o.ttft_ms for o in sample)
            hit = sum(o.cached_tokens for o in sample) / max(1, sum(o.prompt_tokens for o in sample))
            out.append((t, ttft, hit))
        t += WINDOW_S
    return out


def _kill_report(
    outcomes: Sequence[Outcome], kill_s: float, client: LLMClient, args: argparse.Namespace
) -> dict[str, Any]:
    victim = client.endpoints[args.kill_replica]
    retried = [o for o in outcomes if o.ok and o.attempts > 1]
    return {
        "kill_at_s": kill_s,
        "victim": victim.name,
        "victim_ejections": victim.ejections,
        "requests_retried": len(retried),
        "max_ttft_retried_ms": max((o.ttft_ms for o in retried), default=0.0),
    }


def recovery(kill: RunResult, reference: RunResult) -> dict[str, Any]:
    """Compare the kill run with the same run without a kill (same trace, same arrivals), window by
    window: recovered after the last window past the kill whose mean TTFT exceeds the reference's by
    more than 25% (and 50 ms) or whose cache-hit ratio is more than 5 points under it."""
    ref = {t: (ttft, hit) for t, ttft, hit in reference.extra["windows"]}
    kill_s = kill.extra["kill_at_s"]
    recovered_at = kill_s
    worst_ttft = worst_hit = 0.0
    for t, ttft, hit in kill.extra["windows"]:
        if t + WINDOW_S <= kill_s or t not in ref:
            continue
        ref_ttft, ref_hit = ref[t]
        worst_ttft, worst_hit = max(worst_ttft, ttft - ref_ttft), max(worst_hit, ref_hit - hit)
        if ttft > max(1.25 * ref_ttft, ref_ttft + 50) or hit < ref_hit - 0.05:
            recovered_at = t + WINDOW_S
    return {
        "recovery_s": recovered_at - kill_s,
        "worst_window_ttft_excess_ms": worst_ttft,
        "worst_window_hit_ratio_drop": worst_hit,
        "prefill_tokens_excess_vs_no_kill": kill.prefill_tokens - reference.prefill_tokens,
        "reference_windows": reference.extra["windows"],
    }


def targets(results: Sequence[RunResult], at: float) -> list[str]:
    by = {r.policy: r for r in results if abs(r.utilisation - at) < 1e-9}
    if not {"prefix_aware", "round_robin", "least_outstanding"} <= by.keys():
        return []
    pa, rr, lo = by["prefix_aware"], by["round_robin"], by["least_outstanding"]
    checks = [
        (
            "mean TTFT <= 0.4x round_robin",
            pa.ttft_mean_ms / rr.ttft_mean_ms,
            pa.ttft_mean_ms <= 0.4 * rr.ttft_mean_ms,
        ),
        (
            "server-side mean TTFT <= 0.4x round_robin",
            (pa.server_ttft_mean_ms or 0) / (rr.server_ttft_mean_ms or 1),
            (pa.server_ttft_mean_ms or 0) <= 0.4 * (rr.server_ttft_mean_ms or 0),
        ),
        (
            "prefill tokens <= 1.15x oracle",
            pa.prefill_tokens / pa.oracle_prefill_tokens_per_shopper,
            pa.prefill_tokens <= 1.15 * pa.oracle_prefill_tokens_per_shopper,
        ),
        ("p99 TTFT <= least_outstanding", pa.ttft_p99_ms / lo.ttft_p99_ms, pa.ttft_p99_ms <= lo.ttft_p99_ms),
        ("max/mean load <= 1.25", pa.load_max_over_mean, pa.load_max_over_mean <= 1.25),
    ]
    return [f"{'PASS' if ok else 'MISS'}  {name}: {value:.2f}" for name, value, ok in checks]


BOOTSTRAP_SAMPLES = 1000


@dataclass
class Aggregate:
    """One scenario x policy over its repeats. ``ttfts`` pools every repeat's server-side TTFTs (each
    repeat's requests are a sample of the same load shape), so its p99 is the 10th worst of 1,000
    rather than the 5th of 500; ``p99_ci`` is its 95% bootstrap interval (requests resampled within
    each repeat); ``p99_median`` the median of the repeats' own p99s."""

    setup: str
    policy: str
    repeats: int
    requests: int
    lost: int
    ttfts: list[float]
    p50: float
    p99: float
    p99_ci: tuple[float, float]
    p99_median: float
    p99_per_repeat: list[float]
    mean: float
    client_p99_median: float
    prefill_vs_oracle: float
    cache_hit: float
    load_max_over_mean: float
    """The worst repeat's."""
    results: list[RunResult] = field(repr=False, default_factory=list)


def _bootstrap_p99(samples: Sequence[Sequence[float]], rng: random.Random) -> list[float]:
    """Bootstrap distribution of the pooled p99: each repeat's TTFTs resampled with replacement. The
    p99 is ``_pct``'s order statistic, taken as the (n - k)-th largest rather than by sorting every
    resample (the same value, a tenth of the time: ``python -m bench.report`` recomputes these)."""
    n = sum(len(s) for s in samples)
    k = min(n - 1, max(0, round(99 / 100 * (n - 1))))
    out = []
    for _ in range(BOOTSTRAP_SAMPLES):
        resample = [v for s in samples for v in rng.choices(s, k=len(s))]
        out.append(heapq.nlargest(n - k, resample)[-1])
    return out


def aggregate(results: Sequence[RunResult]) -> list[Aggregate]:
    """Pool each (scenario, policy)'s repeats; runs without per-request server TTFTs fall back to the
    client-side ones."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.setup, r.policy), []).append(r)
    out = []
    for (setup, policy), rs in groups.items():
        per_repeat = [list(r.extra.get("server_ttfts_ms") or []) for r in rs]
        pooled = sorted(v for s in per_repeat for v in s)
        boot = sorted(_bootstrap_p99([s for s in per_repeat if s], random.Random(7))) if pooled else [0.0]
        repeat_p99 = [r.server_ttft_p99_ms if r.server_ttft_p99_ms is not None else r.ttft_p99_ms for r in rs]
        prompt = sum(r.prompt_tokens for r in rs)
        out.append(
            Aggregate(
                setup=setup,
                policy=policy,
                repeats=len(rs),
                requests=sum(r.requests for r in rs),
                lost=sum(r.lost for r in rs),
                ttfts=pooled,
                p50=_pct(pooled, 50),
                p99=_pct(pooled, 99) if pooled else statistics.median(repeat_p99),
                p99_ci=(_pct(boot, 2.5), _pct(boot, 97.5)),
                p99_median=statistics.median(repeat_p99),
                p99_per_repeat=repeat_p99,
                mean=statistics.fmean(pooled) if pooled else 0.0,
                client_p99_median=statistics.median(r.ttft_p99_ms for r in rs),
                prefill_vs_oracle=sum(r.prefill_tokens for r in rs)
                / max(1, sum(r.oracle_prefill_tokens_per_shopper for r in rs)),
                cache_hit=sum(r.prompt_tokens * r.cache_hit_ratio for r in rs) / prompt if prompt else 0.0,
                load_max_over_mean=max(r.load_max_over_mean for r in rs),
                results=list(rs),
            )
        )
    return out


def ratio_ci(a: Aggregate, best: Aggregate) -> tuple[float, float] | None:
    """95% bootstrap interval of ``a``'s pooled p99 over ``best``'s (the two resampled independently);
    None for runs stored without per-request TTFTs."""
    num_samples = [s for s in _per_repeat(a) if s]
    den_samples = [s for s in _per_repeat(best) if s]
    if not num_samples or not den_samples:
        return None
    rng = random.Random(11)
    num, den = _bootstrap_p99(num_samples, rng), _bootstrap_p99(den_samples, rng)
    ratios = sorted(x / y for x, y in zip(num, den, strict=True) if y > 0)
    return _pct(ratios, 2.5), _pct(ratios, 97.5)


def _per_repeat(a: Aggregate) -> list[list[float]]:
    return [list(r.extra.get("server_ttfts_ms") or []) for r in a.results]


def scenario_targets(aggregates: Sequence[Aggregate]) -> list[str]:
    """The routing targets for each prefix_aware mode in one scenario, on the repeats pooled: p99 no
    worse than the better baseline (a point estimate; the bootstrap interval of the ratio says how much
    of the margin is noise), prefill <= 1.15x the oracle, the worst repeat's max/mean load <= 1.25."""
    by = {a.policy: a for a in aggregates}
    if not {"round_robin", "least_outstanding"} <= by.keys():
        return []
    best = min(by["round_robin"], by["least_outstanding"], key=lambda a: a.p99)
    lines = []
    for mode in [p for p in by if p.startswith("prefix_aware")]:
        a = by[mode]
        ci = ratio_ci(a, best)
        spread = f"95% CI {ci[0]:.2f}-{ci[1]:.2f}; " if ci else ""
        for name, value, ok, note in (
            (
                f"server p99 / {best.policy}'s",
                a.p99 / best.p99,
                a.p99 <= best.p99,
                f" ({spread}median of runs {a.p99_median / best.p99_median:.2f})",
            ),
            ("prefill / oracle <= 1.15", a.prefill_vs_oracle, a.prefill_vs_oracle <= 1.15, ""),
            ("max/mean load <= 1.25", a.load_max_over_mean, a.load_max_over_mean <= 1.25, ""),
        ):
            lines.append(f"{'PASS' if ok else 'MISS'}  {a.setup} {mode}: {name}: {value:.2f}{note}")
    return lines
