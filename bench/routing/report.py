"""Tables of results, and the JSON files under bench/results/."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.routing.consts import RESULTS
from bench.routing.stats import Aggregate, RunResult


# ---- reporting -------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}, {platform.system()}"


def _md(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


SIM_HEADERS = (
    "util", "policy", "TTFT mean", "TTFT p50", "TTFT p99", "server TTFT mean", "e2e mean", "e2e p99", "req/s",
    "prefill tok", "vs oracle", "vs global bound", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def sim_row(r: RunResult) -> list[str]:
    server = f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-"
    return [
        f"{r.utilisation:.0%}",
        r.policy,
        f"{r.ttft_mean_ms:,.0f}",
        f"{r.ttft_p50_ms:,.0f}",
        f"{r.ttft_p99_ms:,.0f}",
        server,
        f"{r.e2e_mean_ms:,.0f}",
        f"{r.e2e_p99_ms:,.0f}",
        f"{r.throughput_rps:.2f}",
        f"{r.prefill_tokens:,}",
        f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper):.2f}x",
        f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens):.2f}x",
        f"{r.cache_hit_ratio:.0%}",
        f"{r.load_max_over_mean:.2f}",
        str(r.lost),
    ]


def sim_table(results: Sequence[RunResult]) -> str:
    return _md(SIM_HEADERS, [sim_row(r) for r in results])


LLAMA_HEADERS = (
    "policy", "requests", "lost", "TTFT mean ms", "TTFT p99 ms", "e2e mean ms", "cached/prompt", "vs oracle",
    "wall s",
)  # fmt: skip


def llama_table(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.policy,
            str(r.requests),
            str(r.lost),
            f"{r.ttft_mean_ms:,.0f}",
            f"{r.ttft_p99_ms:,.0f}",
            f"{r.e2e_mean_ms:,.0f}",
            f"{r.cache_hit_ratio:.0%}",
            f"{r.extra.get('cached_share_vs_oracle', 0):.2f}",
            f"{r.wall_s:.0f}",
        ]
        for r in results
    ]
    return _md(LLAMA_HEADERS, rows)


def _write(name: str, payload: Any) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(payload, indent=1, default=str) + "\n")


SCENARIO_HEADERS = (
    "scenario", "policy", "server TTFT mean", "server p50", "server p99", "client TTFT mean", "client p99",
    "e2e p99", "prefill vs oracle", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def scenario_table(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.setup,
            r.policy,
            f"{r.server_ttft_mean_ms:,.0f}" if r.server_ttft_mean_ms is not None else "-",
            f"{r.server_ttft_p50_ms:,.0f}" if r.server_ttft_p50_ms is not None else "-",
            f"{r.server_ttft_p99_ms:,.0f}" if r.server_ttft_p99_ms is not None else "-",
            f"{r.ttft_mean_ms:,.0f}",
            f"{r.ttft_p99_ms:,.0f}",
            f"{r.e2e_p99_ms:,.0f}",
            f"{r.prefill_tokens / max(1, r.oracle_prefill_tokens_per_shopper):.2f}x",
            f"{r.cache_hit_ratio:.0%}",
            f"{r.load_max_over_mean:.2f}",
            str(r.lost),
        ]
        for r in results
    ]
    return _md(SCENARIO_HEADERS, rows)


AGGREGATE_HEADERS = (
    "scenario", "policy", "runs", "server TTFT mean", "server p50", "server p99 (pooled)", "95% CI",
    "p99 per run", "client p99 (median)", "prefill ÷ oracle", "cache hit", "max/mean load", "lost",
)  # fmt: skip


def aggregate_table(aggregates: Sequence[Aggregate]) -> str:
    rows = [
        [
            a.setup,
            a.policy,
            str(a.repeats),
            f"{a.mean:,.0f}",
            f"{a.p50:,.0f}",
            f"{a.p99:,.0f}",
            f"{a.p99_ci[0]:,.0f}-{a.p99_ci[1]:,.0f}",
            " / ".join(f"{v:,.0f}" for v in a.p99_per_repeat),
            f"{a.client_p99_median:,.0f}",
            f"{a.prefill_vs_oracle:.2f}x",
            f"{a.cache_hit:.0%}",
            f"{a.load_max_over_mean:.2f}",
            str(a.lost),
        ]
        for a in aggregates
    ]
    return _md(AGGREGATE_HEADERS, rows)


def load_results(paths: Sequence[str]) -> list[RunResult]:
    """The runs stored in ``routing_scenarios*.json`` files."""
    fields = set(RunResult.__dataclass_fields__)
    return [
        RunResult(**{k: v for k, v in r.items() if k in fields})
        for name in paths
        for r in json.loads(Path(name).read_text())["results"]
    ]
