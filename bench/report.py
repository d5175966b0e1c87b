"""``python -m bench.report``: the tables in ``docs/`` that quote a results JSON, regenerated from it, so
a documented number lives in one place (its results file) and cannot drift from it.

A generated table sits between two comments in a doc::

    <!-- bench:table routing_sim bench/results/routing.json -->
    | util | policy | ... |
    <!-- /bench:table -->

The first word names a renderer below; the paths after it are the results files it reads. Without
options the command checks every block of ``docs/*.md`` and ``README.md`` and exits 1 if one differs from
what its files give (``tests/docs/test_bench_tables.py`` runs the same check); ``--write`` rewrites the
blocks; naming docs (``python -m bench.report --write docs/flink.md``) limits either to those. After a rerun
that writes new results, ``--write`` is the whole doc update for those tables; the prose around them is
still written, and checked, by people.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.disagg import SLOS, RatePoint, SetupResult, goodput_text
from bench.goodput_search import brackets_from_json, goodput_cell
from bench.routing.report import aggregate_table, llama_table, load_results, sim_table
from bench.routing.stats import Aggregate, RunResult, aggregate, ratio_ci
from llm_client.routing.prefix_aware import PrefixAwareSettings
from serving.simulator.config import SimulatorConfig
from serving.simulator.hardware import GPUS

BLOCK = re.compile(
    r"(?P<open><!-- bench:table (?P<name>[a-z_]+)(?P<paths>(?: [^ >]+)+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /bench:table -->)",
    re.DOTALL,
)


# ---- renderers: results files -> markdown ------------------------------------------------------------
def printed_table(paths: Sequence[Path]) -> str:
    """The table a benchmark printed and stored, as it is, in its results (``"table"``)."""
    (path,) = paths
    table: str = json.loads(path.read_text())["table"]
    return table


def routing_sim(paths: Sequence[Path]) -> str:
    """The sweep's full table (``docs/routing.md``), as ``python -m bench.routing`` prints it."""
    return sim_table(load_results([str(p) for p in paths]))


def routing_scenarios(paths: Sequence[Path]) -> str:
    """The stress scenarios pooled per scenario and policy (server-side TTFT, p99 with its bootstrap
    interval), as ``python -m bench.routing --setups scenarios`` prints them."""
    return aggregate_table(aggregate(load_results([str(p) for p in paths])))


def routing_sim_summary(paths: Sequence[Path]) -> str:
    """The sweep in the compact form of ``docs/benchmarks.md``, with the oracle's totals under it."""
    (path,) = paths
    payload = json.loads(path.read_text())
    lines = [
        "| util | policy | TTFT mean / p50 / p99 | server TTFT mean | e2e mean / p99 | req/s "
        "| prefill tokens (÷ per-shopper oracle) | cache hit | max/mean load | lost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in load_results([str(path)]):
        server = f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-"
        ratio = r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper)
        lines.append(
            f"| {r.utilisation:.0%} | {r.policy} | {r.ttft_mean_ms:,.0f} / {r.ttft_p50_ms:,.0f} / "
            f"{r.ttft_p99_ms:,.0f} | {server} | {r.e2e_mean_ms:,.0f} / {r.e2e_p99_ms:,.0f} | "
            f"{r.throughput_rps:.2f} | {r.prefill_tokens:,} ({ratio:.2f}) | {r.cache_hit_ratio:.2f} | "
            f"{r.load_max_over_mean:.2f} | {r.lost} |"
        )
    oracle = payload["oracle"]
    lines += [
        "",
        f"Per-shopper oracle: {oracle['prefill_tokens_per_shopper']:,} prefill tokens; global bound (one "
        f"shared infinite cache): {oracle['prefill_tokens_global']:,}; prompt tokens "
        f"{oracle['prompt_tokens']:,}.",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class MixedRow:
    """One row of the table ``python -m bench.regions --scenario mixed`` printed into its results."""

    policy: str
    rate: float
    p50: float
    p99: float
    ci: tuple[float, float]
    slow_share: str
    errors: int


def _mixed_rows(payload: dict[str, Any]) -> list[MixedRow]:
    """The rows of the printed report stored in the results (its bootstrap intervals are computed once,
    at run time, so the report is read back rather than recomputed)."""
    rows = []
    for line in payload["report"].split("\n\n")[0].splitlines()[2:]:
        policy, rate, _requests, p50, p99, share, errors = (c.strip() for c in line.strip("|").split("|"))
        value, interval = p99.split(" [")
        lo, hi = interval.rstrip("]").split(", ")
        ci = (float(lo), float(hi))
        rows.append(MixedRow(policy, float(rate), float(p50), float(value), ci, share, int(errors)))
    return rows


def regions_mixed(paths: Sequence[Path]) -> str:
    """The mixed fleet's ladder (``docs/routing.md``): the lowest p99 that meets the SLO at each rate in
    bold, then each policy's goodput (the highest rate of the ladder whose p99 meets it)."""
    (path,) = paths
    payload = json.loads(path.read_text())
    slo = payload["args"]["slo_ms"] * payload["args"]["time_scale"]
    rows = _mixed_rows(payload)
    best = {
        rate: min((r.p99 for r in rows if r.rate == rate and r.p99 <= slo), default=None)
        for rate in {r.rate for r in rows}
    }
    lines = [
        "| policy | rate/s | TTFT p50 ms | TTFT p99 ms [95% CI] | share on the slow replicas | errors |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        p99 = f"**{r.p99:,.0f}**" if r.p99 == best[r.rate] else f"{r.p99:,.0f}"
        lines.append(
            f"| {r.policy} | {r.rate:g} | {r.p50:,.0f} | {p99} [{r.ci[0]:,.0f}, {r.ci[1]:,.0f}] | "
            f"{r.slow_share} | {r.errors} |"
        )
    if payload.get("searched"):
        lines += [
            "",
            f"Searched goodput (p99 TTFT ≤ {slo / 1000:g} s, every request answered): "
            f"{_mixed_cell(payload)}.",
        ]
        return "\n".join(lines)
    goodputs = _mixed_goodput(payload)
    top = max(goodput for goodput, _ in goodputs.values())
    parts = [f"**{p} {g:g}**" if g == top and g > 0 else f"{p} {g:g}" for p, (g, _) in goodputs.items()]
    per_replica = next(share for goodput, share in goodputs.values() if goodput == top)
    lines += [
        "",
        f"Goodput (p99 TTFT ≤ {slo / 1000:g} s): {', '.join(parts)} requests/s ({per_replica} per replica).",
    ]
    return "\n".join(lines)


def _mixed_goodput(payload: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Each policy's goodput and its share per replica, from the second table of the stored report."""
    table = [line for line in payload["report"].split("\n\n")[1].splitlines()[2:] if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    # a ladder's cell is the rate; a search's is "median [low, high]"
    return {policy: (float(goodput.split(" [")[0]), per_replica) for policy, goodput, per_replica in cells}


SURGE_LINE = re.compile(
    r"^(?P<scenario>surge|lost) \| (?P<setup>[^:]+): (?P<prompts>\d+) prompts, (?P<answered>\d+) answered, "
    r"(?P<errors>\d+) errors; surge-window TTFT p99 (?P<p99>\d+) ms \[(?P<lo>\d+), (?P<hi>\d+)\].*"
    r"prefill tokens/request (?P<prefill>\d+)",
    re.MULTILINE,
)


def _surge_lines(payload: dict[str, Any]) -> dict[str, re.Match[str]]:
    """Each run's summary line of a surge or lost-region report, by setup."""
    return {m["setup"]: m for m in SURGE_LINE.finditer(payload["report"])}


def _command(args: dict[str, Any]) -> str:
    parts = ["python -m bench.regions", f"--scenario {args['scenario']}"]
    if args["scenario"] == "mixed":
        parts.append(f"--policies {','.join(args['policies'])}")
    if args["scenario"] == "lost":
        parts += [f"--lose {args['lose']}", f"--surge {args['surge']:g}"]
    if args.get("search"):
        low, high = args["search"]
        parts.append(f"--search {low:g} {high:g}")
    else:
        parts.append(f"--rates {','.join(f'{r:g}' for r in args['rates'])}")
    parts.append(f"--seconds {args['seconds']:g}")
    return " ".join(parts)


def _mixed_cell(mixed: dict[str, Any]) -> str:
    """The mixed fleet's result: searched goodput per policy with its interval and the verdict, or (a
    ladder) the best goodput and the p99 of the two best at the runner-up's goodput rate."""
    if mixed.get("searched"):
        found = {setup: brackets_from_json(rows) for setup, rows in mixed["searched"].items()}
        cells = ", ".join(f"`{setup}` {goodput_cell(g, digits=1)}" for setup, g in found.items())
        verdicts = [line for line in mixed["report"].splitlines() if "(intervals" in line]
        return f"goodput req/s, median of repeats [interval]: {cells}; {'; '.join(verdicts)}"
    goodputs = sorted(_mixed_goodput(mixed).items(), key=lambda item: -item[1][0])
    (best, (top, _)), (second, (rate, _)) = goodputs[0], goodputs[1]
    at = {r.policy: r for r in _mixed_rows(mixed) if r.rate == rate}
    listed = ", ".join(f"`{p}` {g:g}" for p, (g, _) in goodputs[1:])
    return (
        f"goodput `{best}` **{top:g}** req/s, {listed}; p99 at {rate:g} req/s {at[best].p99:,.0f} ms "
        f"[{at[best].ci[0]:,.0f}, {at[best].ci[1]:,.0f}] against {at[second].p99:,.0f} "
        f"[{at[second].ci[0]:,.0f}, {at[second].ci[1]:,.0f}]"
    )


def regions_summary(paths: Sequence[Path]) -> str:
    """The three regions runs in one table (``docs/benchmarks.md``): the mixed fleet's goodput and the
    p99 of the two best at the runner-up's goodput rate, the surge window with and without spill-over,
    and the lost region's answers with p99 per 5 s of arrivals."""
    mixed, surge, lost = (json.loads(p.read_text()) for p in paths)
    mixed_cell = _mixed_cell(mixed)
    runs = _surge_lines(surge)
    spill, no_spill, calm = runs["spill-over"], runs["no spill-over"], runs["no surge"]
    extra_prefill = int(spill["prefill"]) / int(calm["prefill"]) - 1
    surge_cell = (
        f"surge-window p99 **{int(spill['p99']):,} ms** [{int(spill['lo']):,}, {int(spill['hi']):,}] with "
        f"spill-over against {int(no_spill['p99']) / 1000:.1f} s without; prefill tokens "
        f"{extra_prefill:+.1%} over the same prompts without the surge"
    )
    (run,) = _surge_lines(lost).values()
    windows = lost["report"].split("\n\n")[-1].splitlines()[2:]
    p99s = ", ".join(f"{float(w.strip('|').split('|')[-1]):,.0f}" for w in windows)
    lost_cell = (
        f"{run['answered']} of {run['prompts']} answered, {run['errors']} errors; p99 per 5 s of arrivals "
        f"(the {lost['args']['lose']} lost at {lost['args']['seconds'] / 2:g} s): {p99s} ms"
    )
    return "\n".join(
        [
            "| scenario (command) | result |",
            "|---|---|",
            f"| mixed fleet, 4 H100 + 2 half-speed (`{_command(mixed['args'])}`) | {mixed_cell} |",
            f"| regional surge, west {surge['args']['surge']:g}x for a third of the run, east "
            f"{surge['args']['rtt_ms']:g} ms away (`{_command(surge['args'])}`) | {surge_cell} |",
            f"| a region lost mid-run (`{_command(lost['args'])}`) | {lost_cell} |",
        ]
    )


def _printed_rows(table: str) -> list[dict[str, str]]:
    """The rows of a table ``bench.common.print_table`` printed, by header."""
    lines = table.strip().splitlines()
    headers = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(headers, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]
    ]


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def gateway_latency(paths: Sequence[Path]) -> str:
    """``python -m bench.gateway``'s fixed-rate part: what the extra hop adds, per policy."""
    (path,) = paths
    lines = [
        "| policy | path | TTFT p50 ms | TTFT p99 ms | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| gateway CPU µs/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in _printed_rows(json.loads(path.read_text())["latency"]):
        times = " | ".join(
            f"{_number(row[k]):.1f}" for k in ("TTFT p50 ms", "TTFT p99 ms", "p50 ms", "p99 ms")
        )
        added = "- | - | -"
        if row["path"] == "gateway":
            added = (
                f"**{_number(row['added p50 ms']):+.1f}** | {_number(row['added p99 ms']):.1f} | "
                f"{_number(row['gateway CPU µs/request']):,.0f}"
            )
        lines.append(f"| {row['policy']} | {row['path']} | {times} | {added} |")
    return "\n".join(lines)


def gateway_ceiling(paths: Sequence[Path]) -> str:
    """``python -m bench.gateway``'s closed-loop part: the rate each path reaches, the gateway's CPU."""
    (path,) = paths
    lines = [
        "| policy | path | req/s | p50 ms | p99 ms | gateway CPU µs/request |",
        "|---|---|---|---|---|---|",
    ]
    for row in _printed_rows(json.loads(path.read_text())["ceiling"]):
        cpu = "-" if row["path"] != "gateway" else f"**{_number(row['gateway CPU µs/request']):,.0f}**"
        lines.append(
            f"| {row['policy']} | {row['path']} | {_number(row['req/s']):.1f} | "
            f"{_number(row['p50 ms']):,.0f} | {_number(row['p99 ms']):,.0f} | {cpu} |"
        )
    return "\n".join(lines)


DISAGG_LABELS = {
    "4P4D-remote": "4P4D-remote (pure P/D)",
    "4P4D-cond": "4P4D-cond (size rule, 512)",
    "4P4D-idle": "**4P4D-idle (`pd_aware` defaults)**",
}
"""How ``docs/disaggregation.md`` names the setups it compares."""


def load_setups(path: Path) -> list[SetupResult]:
    """A ``bench.disagg`` results file: a list of setups (before the search) or ``{"results": [...]}``."""
    payload = json.loads(path.read_text())
    rows = payload["results"] if isinstance(payload, dict) else payload
    return [
        SetupResult(
            s["workload"],
            s["cost"],
            s["setup"],
            s["gpus_context"],
            [
                RatePoint(**{**p, "ttft_ci": tuple(p["ttft_ci"]), "itl_ci": tuple(p["itl_ci"])})
                for p in s["points"]
            ],
            s.get("searched", {}),
        )
        for s in rows
    ]


def disagg_goodput(paths: Sequence[Path]) -> str:
    """Goodput per GPU in each SLO column (``python -m bench.disagg``'s verdict) for each results file in
    turn: searched, the median of the repeats with the interval from the lowest passing to the highest
    failing rate; or, for a ladder's results, its best rung with the p99 TTFT interval there."""
    header = " | ".join(f"TTFT≤{t / 1000:g} s, ITL≤{i:g} ms" for t, i in SLOS)
    lines = [f"| workload | cost | setup | {header} |", "|---|---|---|" + "---|" * len(SLOS)]
    for path in paths:
        for result in load_setups(path):
            cells = [goodput_text(result, ttft_slo, itl_slo) for ttft_slo, itl_slo in SLOS]
            label = DISAGG_LABELS.get(result.setup, result.setup)
            lines.append(f"| {result.workload} | {result.cost} | {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


# ---- routing: kill, llama-server, stress targets, load factor ------------------------------------------
def _prefill_vs_oracle(r: dict[str, Any]) -> str:
    return f"{r['prefill_tokens'] / max(1, r['oracle_prefill_tokens_per_shopper']):.2f}x"


def routing_kill(paths: Sequence[Path]) -> str:
    """``python -m bench.routing --setups kill``: the run with a replica SIGKILLed halfway beside the
    same run without the kill, then what the kill report measured."""
    (path,) = paths
    payload = json.loads(path.read_text())
    lines = [
        "| run | TTFT mean | TTFT p50 | TTFT p99 | server TTFT | e2e mean | e2e p99 | prefill vs oracle "
        "| cache hit | max/mean load | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in (("no kill", payload["reference"]), ("kill", payload["result"])):
        lost = f"**{r['lost']}**" if label == "kill" else str(r["lost"])
        lines.append(
            f"| {label} | {r['ttft_mean_ms']:,.0f} | {r['ttft_p50_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} | "
            f"{r['server_ttft_mean_ms']:,.0f} | {r['e2e_mean_ms']:,.0f} | {r['e2e_p99_ms']:,.0f} | "
            f"{_prefill_vs_oracle(r)} | {r['cache_hit_ratio']:.0%} | {r['load_max_over_mean']:.2f} | {lost} |"
        )
    kill, extra = payload["result"], payload["result"]["extra"]
    lines += [
        "",
        f"{kill['completed']:,} of {kill['requests']:,} answered, {kill['lost']} lost; the victim ejected "
        f"{extra['ejected_after_s']:.3f} s (simulated) after the kill at {extra['kill_at_s']:.1f} s; "
        f"{extra['requests_retried']} requests retried on other replicas (the slowest answer "
        f"{extra['max_ttft_retried_ms'] / 1000:.1f} s); prefill tokens "
        f"{extra['prefill_tokens_excess_vs_no_kill']:+,} against the run without the kill.",
    ]
    return "\n".join(lines)


def routing_llama(paths: Sequence[Path]) -> str:
    """The llama-server runs of ``python -m bench.routing --setups llama``, as it prints them."""
    return llama_table([r for r in load_results([str(p) for p in paths]) if r.setup == "llama"])


def routing_llama_summary(paths: Sequence[Path]) -> str:
    """The llama-server runs in the compact form of ``docs/benchmarks.md``."""
    lines = [
        "| policy | TTFT mean ms | cached/prompt tokens | ÷ oracle's cached share |",
        "|---|---|---|---|",
    ]
    for r in load_results([str(p) for p in paths]):
        if r.setup == "llama":
            lines.append(
                f"| {r.policy} | {r.ttft_mean_ms:,.0f} | {r.cache_hit_ratio:.2f} | "
                f"{r.extra.get('cached_share_vs_oracle', 0):.2f} |"
            )
    return "\n".join(lines)


def _at_70(path: Path) -> dict[str, RunResult]:
    return {r.policy: r for r in load_results([str(path)]) if abs(r.utilisation - 0.7) < 1e-9}


def _targets_cells(path: Path) -> tuple[list[str], list[bool]]:
    """The four routing targets at 70% for one sweep (``stats.targets``'s rules, client-side), with the
    server-side figures beside them where the run kept per-request server TTFTs."""
    by = _at_70(path)
    pa, rr, lo = by["prefix_aware"], by["round_robin"], by["least_outstanding"]
    kept = bool(pa.extra.get("server_ttfts_ms"))
    pooled = {a.policy: a for a in aggregate(list(by.values()))} if kept else {}
    server_mean = (pa.server_ttft_mean_ms or 0) / (rr.server_ttft_mean_ms or 1)
    p99 = f"{pa.ttft_p99_ms:,.0f} vs {lo.ttft_p99_ms:,.0f} ms ({pa.ttft_p99_ms / lo.ttft_p99_ms:.2f}x)"
    if pooled:
        a, b = pooled["prefix_aware"], pooled["least_outstanding"]
        p99 += (
            f"; server-side {a.p99:,.0f} [{a.p99_ci[0]:,.0f}, {a.p99_ci[1]:,.0f}] vs {b.p99:,.0f} "
            f"[{b.p99_ci[0]:,.0f}, {b.p99_ci[1]:,.0f}] ({a.p99 / b.p99:.2f}x)"
        )
    cells = [
        f"{pa.ttft_mean_ms / rr.ttft_mean_ms:.2f}x (server-side {server_mean:.2f}x)",
        f"{pa.prefill_tokens / pa.oracle_prefill_tokens_per_shopper:.2f}x "
        f"({pa.prefill_tokens / pa.oracle_prefill_tokens:.2f}x the global bound)",
        p99,
        f"{pa.load_max_over_mean:.2f}",
    ]
    met = [
        pa.ttft_mean_ms <= 0.4 * rr.ttft_mean_ms,
        pa.prefill_tokens <= 1.15 * pa.oracle_prefill_tokens_per_shopper,
        pa.ttft_p99_ms <= lo.ttft_p99_ms,
        pa.load_max_over_mean <= 1.25,
    ]
    return cells, met


def routing_targets(paths: Sequence[Path]) -> str:
    """The sweep's targets at 70% (prefix_aware) before and after: the first file, then the second;
    the verdict is the second's. Server-side p99 is pooled with its 95% bootstrap interval
    (``stats.aggregate``) where the run kept per-request server TTFTs."""
    before_path, after_path = paths
    (before, _), (after, met) = _targets_cells(before_path), _targets_cells(after_path)
    names = (
        "mean TTFT <= 0.4x round_robin",
        "prefill tokens <= 1.15x oracle",
        "p99 TTFT no worse than least_outstanding",
        "max/mean load <= 1.25",
    )
    lines = [
        f"| target | before (`{before_path.name}`) | after (`{after_path.name}`) | verdict, after |",
        "|---|---|---|---|",
    ]
    for name, old, new, ok in zip(names, before, after, met, strict=True):
        lines.append(f"| {name} | {old} | {new} | {'met' if ok else '**missed**'} |")
    return "\n".join(lines)


def _mean_interval(values: Sequence[float], seed: int = 7, samples: int = 1000) -> tuple[float, float]:
    """95% bootstrap interval of a mean (the values resampled with replacement, seeded)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(samples))
    return means[round(0.025 * (samples - 1))], means[round(0.975 * (samples - 1))]


def routing_server_side(paths: Sequence[Path]) -> str:
    """The sweep's server-side TTFT per run (the replicas' own first-token times, ``server_ttfts_ms``):
    p99 with its 95% bootstrap interval (``stats.aggregate``) and the mean with its own."""
    lines = [
        "| util | policy | requests | server TTFT p99 ms [95% CI] | server TTFT mean ms [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for r in load_results([str(p) for p in paths]):
        ttfts = list(r.extra.get("server_ttfts_ms") or [])
        if not ttfts:
            continue
        (a,) = aggregate([r])
        lo, hi = _mean_interval(ttfts)
        lines.append(
            f"| {r.utilisation:.0%} | {r.policy} | {len(ttfts):,} | {a.p99:,.0f} [{a.p99_ci[0]:,.0f}, "
            f"{a.p99_ci[1]:,.0f}] | {a.mean:,.0f} [{lo:,.0f}, {hi:,.0f}] |"
        )
    return "\n".join(lines)


BASELINE_SHORT = {"round_robin": "rr", "least_outstanding": "lo"}


def routing_scenario_targets(paths: Sequence[Path]) -> str:
    """Per scenario with both baselines, each prefix_aware mode's pooled server-side p99 over the better
    baseline's with the 95% bootstrap interval of that ratio, prefill over the oracle (over 1.15: a
    miss) and the worst replay's max/mean load."""
    by_scenario: dict[str, list[Aggregate]] = {}
    for a in aggregate(load_results([str(p) for p in paths])):
        by_scenario.setdefault(a.setup, []).append(a)
    lines = [
        "| scenario | mode | server p99 ÷ better baseline (95% CI) | prefill ÷ oracle | max/mean load |",
        "|---|---|---|---|---|",
    ]
    for scenario, found in by_scenario.items():
        by = {a.policy: a for a in found}
        if not {"round_robin", "least_outstanding"} <= by.keys():
            continue
        best = min(by["round_robin"], by["least_outstanding"], key=lambda a: a.p99)
        for mode in (p for p in by if p.startswith("prefix_aware")):
            a = by[mode]
            ci = ratio_ci(a, best)
            interval = f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
            prefill = f"{a.prefill_vs_oracle:.2f}" + (" **miss**" if a.prefill_vs_oracle > 1.15 else "")
            lines.append(
                f"| {scenario} | {mode} | {a.p99 / best.p99:.2f}{interval} ÷ {BASELINE_SHORT[best.policy]} | "
                f"{prefill} | {a.load_max_over_mean:.2f} |"
            )
    return "\n".join(lines)


def routing_load_factor(paths: Sequence[Path]) -> str:
    """The ``load_factor`` ablation, utilisation by utilisation, the default in bold. One file: a sweep of
    ``prefix_aware`` beside ``prefix_aware/load_factor=X`` (same trace and arrivals). Two files (how the
    first ablation ran): prefix_aware's runs of the first, with the factor changed, and of the second, the
    sweep at the default."""
    default = f"**{PrefixAwareSettings().load_factor:g}**"
    runs: list[tuple[str, RunResult]] = []
    if len(paths) == 1:
        for r in load_results([str(paths[0])]):
            if r.policy == "prefix_aware":
                runs.append((default, r))
            elif r.policy.startswith("prefix_aware/load_factor="):
                runs.append((r.policy.split("=", 1)[1], r))
    else:
        ablation, sweep = paths
        factor = json.loads(json.loads(ablation.read_text())["args"]["prefix_aware_options"])["load_factor"]
        runs = [(f"{factor:g}", r) for r in load_results([str(ablation)]) if r.policy == "prefix_aware"] + [
            (default, r) for r in load_results([str(sweep)]) if r.policy == "prefix_aware"
        ]
    lines = [
        "| util | load_factor | TTFT mean | TTFT p99 | server TTFT | prefill vs oracle | max/mean load |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in sorted(runs, key=lambda run: (run[1].utilisation, run[0] == default)):
        server = f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-"
        lines.append(
            f"| {r.utilisation:.0%} | {label} | {r.ttft_mean_ms:,.0f} | {r.ttft_p99_ms:,.0f} | {server} | "
            f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper):.2f}x | "
            f"{r.load_max_over_mean:.2f} |"
        )
    return "\n".join(lines)


# ---- regions: the surge and the lost region, in full -----------------------------------------------------
SURGE_FULL = re.compile(
    r"^(?:surge|lost) \| (?P<setup>[^:]+): (?P<prompts>\d+) prompts, (?P<answered>\d+) answered, "
    r"(?P<errors>\d+) errors; surge-window TTFT p99 (?P<p99>\d+) ms \[(?P<lo>\d+), (?P<hi>\d+)\], whole run "
    r"p99 (?P<whole>\d+) ms; share east (?P<east>[\d.]+); prefill tokens/request (?P<prefill>\d+); spills "
    r"(?P<spills>\d+) returns (?P<returns>\d+)",
    re.MULTILINE,
)


def regions_surge(paths: Sequence[Path]) -> str:
    """``python -m bench.regions --scenario surge``: each run's surge window, with prefill per request
    against the same prompts without the surge."""
    (path,) = paths
    runs = {m["setup"]: m for m in SURGE_FULL.finditer(json.loads(path.read_text())["report"])}
    calm = int(runs["no surge"]["prefill"])
    lines = [
        "| run | prompts | errors | surge-window TTFT p99 ms [95% CI] | whole run p99 | share east "
        "| prefill tokens / request | spills / returns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setup, m in runs.items():
        p99 = f"{int(m['p99']):,}"
        prefill = f"{int(m['prefill']):,}"
        if setup == "spill-over":
            p99 = f"**{p99}**"
        if setup != "no surge":
            extra = f"{int(m['prefill']) / calm - 1:+.1%}"
            prefill += f" ({extra} over no surge)" if setup == "spill-over" else f" ({extra})"
        lines.append(
            f"| {setup} | {m['prompts']} | {m['errors']} | {p99} [{int(m['lo']):,}, {int(m['hi']):,}] | "
            f"{int(m['whole']):,} | {float(m['east']):g} | {prefill} | {m['spills']} / {m['returns']} |"
        )
    return "\n".join(lines)


def regions_lost(paths: Sequence[Path]) -> str:
    """``python -m bench.regions --scenario lost``: answers and TTFT per 5 s of arrivals, as it printed
    them (its last table)."""
    (path,) = paths
    rows = _printed_rows(json.loads(path.read_text())["report"].split("\n\n")[-1])
    # the share column names the region that survives: "share answered in east" when the west is lost
    (share,) = [column for column in rows[0] if column.startswith("share answered in")]
    lines = [
        f"| arrivals | answered | errors | {share} | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['arrivals']} | {row['answered']} | {row['errors']} | {row[share]} | "
            f"{_number(row['TTFT p50 ms']):,.0f} | {_number(row['TTFT p99 ms']):,.0f} |"
        )
    return "\n".join(lines)


# ---- batch, real time, capacity ---------------------------------------------------------------------------
def batch_runs(paths: Sequence[Path]) -> str:
    """``python -m bench.batch``: the fixed-concurrency runs and the adaptive one, then the ratio and
    the kill-and-resume cost."""
    (path,) = paths
    payload = json.loads(path.read_text())
    top = max(run["concurrency"] for run in payload["fixed_runs"])
    lines = ["| run | calls/s | steady calls/s | simulated GPU busy |", "|---|---|---|---|"]
    for run in payload["fixed_runs"]:
        note = " (the pool's measured maximum)" if run["concurrency"] == top else ""
        lines.append(
            f"| fixed concurrency {run['concurrency']}{note} | {run['calls_per_s']:.1f} | "
            f"{run['steady_calls_per_s']:.1f} | {run['gpu_busy_pct']:.0f}% |"
        )
    adaptive, kill = payload["adaptive"], payload["kill"]
    lines += [
        f"| adaptive (AIMD), {adaptive['records']:,} records | {adaptive['calls_per_s']:.1f} | "
        f"{adaptive['steady_calls_per_s']:.1f} | {adaptive['gpu_busy_pct']:.0f}% |",
        "",
        f"Adaptive ÷ measured maximum = **{payload['ratio_overall']:.3f}** over the whole job, ramp-up "
        f"included ({payload['ratio_steady']:.3f} steady). SIGKILL at half, then `resume`: "
        f"**{kill['records_redone']} records redone ({kill['records_redone_pct']:.2f}%)**.",
    ]
    return "\n".join(lines)


def batch_kill(paths: Sequence[Path]) -> str:
    """``python -m bench.batch``'s kill-and-resume run: records and calls done twice."""
    (path,) = paths
    kill = json.loads(path.read_text())["kill"]
    lines = [
        "| records | done at kill | kept (parts written) | records redone | redone % | calls needed | "
        "calls spent | extra calls | extra % |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {kill['records']:,} | {kill['done_at_kill']:,} | {kill['kept_at_kill']:,} | "
        f"{kill['records_redone']:,} | **{kill['records_redone_pct']:.2f}** | "
        f"{kill['calls_needed']:,} | {kill['calls_spent']:,} | "
        f"{kill['calls_redone']:,} | {kill['calls_redone_pct']:.2f} |",
    ]
    return "\n".join(lines)


def _ms(value: float) -> str:
    """A latency in the precision it is read at: tenths under 100 ms, whole ms above."""
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _handler_ms(phase: dict[str, Any], quantile: str) -> str:
    """The overhead spent inside the service's handler, or "-" in results from before it was kept."""
    value = phase.get(f"handler_overhead_{quantile}_ms")
    return "-" if value is None else _ms(value)


def realtime_pairs(paths: Sequence[Path]) -> str:
    """``python -m bench.realtime`` before and after, phase by phase: refusals, late answers, overhead
    and the service's CPU per request. One file: that run alone (service "this tree")."""
    runs = [json.loads(p.read_text()) for p in paths]
    names = ("before", "after") if len(runs) == 2 else ("this tree",)
    lines = [
        "| phase | service | refused (429) | late answers | overhead p50 / p99 ms | service CPU ms/req |",
        "|---|---|---|---|---|---|",
    ]
    for phases in zip(*(run["phases"] for run in runs), strict=True):
        label = f"{phases[0]['offered_rps']:.0f} req/s" + (" (2×)" if "2x" in phases[0]["phase"] else "")
        for name, phase in zip(names, phases, strict=True):
            refused = str(phase["refused"]) if phase["refused"] else "-"
            late = f"{phase['late']:,} of {phase['requests']:,} ({phase['late'] / phase['requests']:.1%})"
            lines.append(
                f"| {label} | {name} | {refused} | {late} | {_ms(phase['overhead_p50_ms'])} / "
                f"{_ms(phase['overhead_p99_ms'])} | {phase['cpu_ms_per_request']['service']:.2f} |"
            )
    return "\n".join(lines)


def realtime_runs(paths: Sequence[Path]) -> str:
    """Several ``python -m bench.realtime`` runs in the order they ran, each named by its results file
    (less the part every name shares): per phase, late answers, refusals, overhead (and how much of
    it was inside the service's handler, its ``elapsed_ms`` less the model's time), the CPU per
    request of the service and of the replicas, and the model calls cut at their deadline that were
    read to their end within the grace (connection kept), closed at its end, or closed at once (recent
    cut calls had not finished within it)."""
    stems = [p.stem for p in paths]
    common = len(os.path.commonprefix(stems))  # noqa: RUF071 -- of names, character by character
    lines = [
        "| run | phase | refused (429) | late answers | overhead p50 / p99 ms | of it in the handler p50 / "
        "p99 ms | CPU ms/req: service / replicas | cut calls kept / closed / closed at once |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stem, path in zip(stems, paths, strict=True):
        for phase in json.loads(path.read_text())["phases"]:
            label = f"{phase['offered_rps']:.0f} req/s" + (" (2×)" if "2x" in phase["phase"] else "")
            refused = str(phase["refused"]) if phase["refused"] else "-"
            cpu = phase["cpu_ms_per_request"]
            lines.append(
                f"| {stem[common:] or stem} | {label} | {refused} | {phase['late']:,} | "
                f"{_ms(phase['overhead_p50_ms'])} / {_ms(phase['overhead_p99_ms'])} | "
                f"{_handler_ms(phase, 'p50')} / {_handler_ms(phase, 'p99')} | "
                f"{cpu['service']:.2f} / {cpu['replicas']:.2f} | "
                f"{phase.get('cut_kept', '-')} / {phase.get('cut_closed', '-')} / "
                f"{phase.get('cut_closed_at_once', '-')} |"
            )
    return "\n".join(lines)


def realtime_cpu(paths: Sequence[Path]) -> str:
    """``python -m bench.realtime --arm ...``: each service's CPU per request at equal work, and its
    ratio to the first service's in the same round (the only comparison the load average leaves)."""
    payload = json.loads(paths[0].read_text())
    arms = payload["arms"]
    first = next(iter(arms))
    lines = [
        f"| service | CPU ms/request (median of {len(payload['rounds'])} rounds) | ratio to {first}: median "
        "(rounds' range) | overhead p50 / p99 ms |",
        "|---|---|---|---|",
    ]
    for label, arm in arms.items():
        low, high = arm["ratio_to_first_range"]
        ratio = "1" if label == first else f"**{arm['ratio_to_first_median']:.2f}** ({low:.2f}-{high:.2f})"
        lines.append(
            f"| {label} | {arm['cpu_ms_median']:.2f} | {ratio} | {_ms(arm['overhead_p50_ms_median'])} / "
            f"{_ms(arm['overhead_p99_ms_median'])} |"
        )
    loads = [payload["load_average_before"][0], payload["load_average_after"][0]]
    loads += [row[label]["load_average"] for row in payload["rounds"] for label in arms]
    lines += ["", f"Load average {min(loads):.1f}-{max(loads):.1f}; {payload['machine']}."]
    return "\n".join(lines)


def realtime_profile(paths: Sequence[Path]) -> str:
    """The py-spy round of ``bench.realtime --arm ... --profile-dir``: where each service's on-CPU
    samples are, by package (the innermost frame in a known package)."""
    profiles = json.loads(paths[0].read_text())["profiles"]
    labels = list(profiles)
    parts = sorted(
        {p for shares in profiles.values() for p in shares}, key=lambda p: -profiles[labels[-1]].get(p, 0)
    )
    lines = ["| where the CPU goes | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for part in parts:
        lines.append(f"| {part} | " + " | ".join(f"{profiles[a].get(part, 0):.0%}" for a in labels) + " |")
    return "\n".join(lines)


def capacity_splits(paths: Sequence[Path]) -> str:
    """``python -m bench.capacity`` and its ``--static`` runs: the same compressed day per split."""
    lines = [
        "| split | real-time p99 | degraded | late | batch records in the day |",
        "|---|---|---|---|---|",
    ]
    for path in paths:
        run = json.loads(path.read_text())
        mode = run["mode"]
        split = "shifting controller" if mode == "shifting" else mode.replace("/", " real-time / ") + " batch"
        lines.append(
            f"| {split} | {run['rt_p99_ms']:.0f} ms | {run['degraded_pct']:.2f}% | {run['late']:,} | "
            f"{run['batch_records']:,} |"
        )
    return "\n".join(lines)


def capacity_parts(paths: Sequence[Path]) -> str:
    """One ``python -m bench.capacity`` run, part of the day by part of the day."""
    (path,) = paths
    lines = [
        "| part of day | rt req/s | rt replicas | rt p99 ms | degraded % | batch records/s |",
        "|---|---|---|---|---|---|",
    ]
    for part in json.loads(path.read_text())["parts"]:
        lines.append(
            f"| {part['part']} | {part['rt_rps']:.1f} | "
            f"{part['rt_replicas_min']}-{part['rt_replicas_max']} | {part['rt_p99_ms']:.0f} | "
            f"{part['degraded_pct']:.2f} | {part['batch_records_per_s']:.1f} |"
        )
    return "\n".join(lines)


# ---- overload on fleets of other serving options ----------------------------------------------------
def overload_fleets(paths: Sequence[Path]) -> str:
    """``python -m bench.overload`` on fleets of other serving options (its ``fleet``), rate by rate:
    capacity, what landed, and where purchase and cart answers spend their time."""
    lines = [
        "| replicas | KV share | arm | capacity (1x) prompts/s | rate | landed "
        "| landed p99 s | purchase+cart p99 from due s | purchase+cart first token mean / p99 s "
        "| purchase+cart decode mean / p99 s | ms per iteration | tokens per insight |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        run = json.loads(path.read_text())
        label, share = run["fleet"], _kv_share(run["replica_settings"])
        for row in run["rows"]:
            urgent = [
                row["by_kind"][k]["from_due_p99"] for k in ("purchase", "add_to_cart") if k in row["by_kind"]
            ]
            first = row["where_time_goes_s"]["purchase_cart"]["replica_ttft"]
            decode = row["where_time_goes_s"]["purchase_cart"]["decode"]
            engine = row["tokens"]["engine"]
            tokens = row["accounting"]["insights"] and (
                (row["tokens"]["landed_prefill"] + row["tokens"]["landed_decode"])
                / row["accounting"]["insights"]
            )
            lines.append(
                f"| {label} | {share} | `{row['arm']}` | {run['capacity']['prompts_per_s']:.1f} | "
                f"{row['multiple']:g}x | {row['accounting']['insights']:,} | "
                f"{row['freshness_s']['p99']:.1f} | {max(urgent):.1f} | "
                f"{first['mean']:.1f} / {first['p99']:.1f} | {decode['mean']:.1f} / {decode['p99']:.1f} | "
                f"{_ms_per_iteration(engine)} | {tokens:.0f} |"
            )
    return "\n".join(lines)


def _ms_per_iteration(engine: dict[str, float]) -> str:
    """The replicas' busy time over their iterations; under P/D per pool, where the results have them
    (a context server's iteration is a batch of prefills, a generation server's mostly a decode step)."""
    if "generation.iterations" in engine:
        pools = [("ctx", "context"), ("gen", "generation")]
        return " / ".join(
            f"{short} {engine[f'{pool}.busy_ms'] / max(1.0, engine[f'{pool}.iterations']):.0f}"
            for short, pool in pools
        )
    return f"{engine['busy_ms'] / engine['iterations']:.0f}"


def _kv_share(replica_settings: dict[str, Any]) -> str:
    """The replicas' ``free_gpu_memory_fraction`` as the run recorded it (settings equal to the
    simulator's defaults are left out of a results file); per role under P/D, whose files set their own."""
    if "disaggregated" in replica_settings:
        return "per role"
    default = SimulatorConfig.model_fields["free_gpu_memory_fraction"].default
    return f"{replica_settings.get('free_gpu_memory_fraction', default):g}"


# ---- the simulator's fidelity ------------------------------------------------------------------------------
def fidelity(paths: Sequence[Path]) -> str:
    """``python -m bench.fidelity``: simulated output throughput against TensorRT-LLM's published
    figure, per GPU and ISL/OSL, then the largest error."""
    (path,) = paths
    rows = json.loads(path.read_text())["rows"]
    lines = [
        "| GPU | ISL/OSL | requests | max batch / tokens (trtllm-bench) | KV blocks | peak running "
        "| published tok/s | simulated tok/s | error | sim. mean TTFT ms | sim. mean TPOT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {GPUS[r['gpu']].name} | {r['isl']}/{r['osl']} | {r['requests']:,} | "
            f"{r['max_batch']:,} / {r['max_num_tokens']:,} | {r['kv_blocks']:,} | {r['peak_running']:,} | "
            f"{r['published_tokens_per_s']:,} | {r['simulated_tokens_per_s']:,.0f} | {r['error']:+.1%} | "
            f"{r['mean_ttft_ms']:,.0f} | {r['mean_tpot_ms']:.1f} |"
        )
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += [
        "",
        f"Largest error {abs(worst['error']):.1%} ({GPUS[worst['gpu']].name.split()[0]} "
        f"{worst['isl']}/{worst['osl']}), over {len(rows)} figures.",
    ]
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[Sequence[Path]], str]] = {
    "printed_table": printed_table,
    "overload_fleets": overload_fleets,
    "routing_sim": routing_sim,
    "routing_sim_summary": routing_sim_summary,
    "routing_scenarios": routing_scenarios,
    "regions_mixed": regions_mixed,
    "regions_summary": regions_summary,
    "disagg_goodput": disagg_goodput,
    "gateway_latency": gateway_latency,
    "gateway_ceiling": gateway_ceiling,
    "routing_kill": routing_kill,
    "routing_llama": routing_llama,
    "routing_llama_summary": routing_llama_summary,
    "routing_scenario_targets": routing_scenario_targets,
    "routing_targets": routing_targets,
    "routing_server_side": routing_server_side,
    "routing_load_factor": routing_load_factor,
    "batch_kill": batch_kill,
    "capacity_parts": capacity_parts,
    "regions_surge": regions_surge,
    "regions_lost": regions_lost,
    "batch_runs": batch_runs,
    "realtime_pairs": realtime_pairs,
    "realtime_runs": realtime_runs,
    "realtime_cpu": realtime_cpu,
    "realtime_profile": realtime_profile,
    "capacity_splits": capacity_splits,
    "fidelity": fidelity,
}


# ---- the blocks in the docs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One generated table in a doc: where it is, what renders it, and whether it is current."""

    doc: Path
    name: str
    paths: tuple[Path, ...]
    written: str
    rendered: str

    @property
    def current(self) -> bool:
        return self.written == self.rendered


Rendered = dict[tuple[str, tuple[Path, ...]], str]
"""Tables already rendered in one check, by renderer and files: the stress scenarios' bootstrap takes
seconds, and the same results feed tables in several docs."""


def render(name: str, paths: Sequence[Path], cache: Rendered | None = None) -> str:
    if name not in RENDERERS:
        raise ValueError(f"no renderer {name!r}; known: {', '.join(RENDERERS)}")
    key = (name, tuple(paths))
    if cache is not None and key in cache:
        return cache[key]
    table = RENDERERS[name](paths).rstrip("\n") + "\n"
    if cache is not None:
        cache[key] = table
    return table


def blocks(
    doc: Path, text: str | None = None, root: Path = REPO, cache: Rendered | None = None
) -> list[Block]:
    """The generated tables of ``doc`` (its text, or ``text`` in its place), each rendered afresh (or
    taken from ``cache``, filled by earlier calls of the same check)."""
    text = doc.read_text() if text is None else text
    found = []
    for match in BLOCK.finditer(text):
        paths = tuple(root / p for p in match["paths"].split())
        found.append(Block(doc, match["name"], paths, match["body"], render(match["name"], paths, cache)))
    return found


def regenerate(text: str, root: Path = REPO, cache: Rendered | None = None) -> str:
    """``text`` with every generated table replaced by what its results files give now."""

    def one(match: re.Match[str]) -> str:
        paths = [root / p for p in match["paths"].split()]
        return match["open"] + render(match["name"], paths, cache) + match["close"]

    return BLOCK.sub(one, text)


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables from their results files")
    parser.add_argument(
        "docs", nargs="*", type=Path, help="only these docs (default: README.md and every docs/*.md)"
    )
    args = parser.parse_args(argv)
    stale = 0
    cache: Rendered = {}
    for doc in [path.resolve() for path in args.docs] or documents():
        text = doc.read_text()
        found = blocks(doc, text, cache=cache)
        for block in found:
            status = "ok" if block.current else ("rewritten" if args.write else "DIFFERS")
            stale += not block.current
            paths = " ".join(str(p.relative_to(REPO)) for p in block.paths)
            print(f"{doc.relative_to(REPO)}: {block.name} ({paths}): {status}")
        if args.write and found:
            doc.write_text(regenerate(text, cache=cache))
    return 0 if args.write or not stale else 1


if __name__ == "__main__":
    sys.exit(main())
