"""The PNG plots (matplotlib, optional)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.routing.consts import POLICIES, RESULTS
from bench.routing.stats import WINDOW_S, RunResult


def plot(results: Sequence[RunResult], kill: RunResult | None, out: Path, tag: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results:
        _plot_sweep(plt, results, out / f"routing{tag}.png")
    if kill is not None and kill.extra.get("windows"):
        _plot_kill(plt, kill, out / f"routing{tag}_kill.png")


def _plot_sweep(plt: Any, results: Sequence[RunResult], path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for policy in POLICIES:
        rs = sorted((r for r in results if r.policy == policy), key=lambda r: r.utilisation)
        if not rs:
            continue
        u = [100 * r.utilisation for r in rs]
        axes[0].plot(u, [r.ttft_mean_ms for r in rs], marker="o", label=policy)
        axes[1].plot(u, [r.ttft_p99_ms for r in rs], marker="o", label=policy)
        axes[2].plot(u, [r.e2e_mean_ms / 1000 for r in rs], marker="o", label=policy)
        axes[3].plot(
            u, [r.prefill_tokens / r.oracle_prefill_tokens_per_shopper for r in rs], marker="o", label=policy
        )
    axes[0].set(
        title="mean TTFT", xlabel="utilisation of cache-oblivious capacity (%)", ylabel="ms (simulated)"
    )
    axes[1].set(title="p99 TTFT", xlabel="utilisation (%)", ylabel="ms (simulated)")
    axes[2].set(title="mean end-to-end latency", xlabel="utilisation (%)", ylabel="s (simulated)")
    axes[3].set(title="prefill tokens computed / oracle", xlabel="utilisation (%)", ylabel="x oracle")
    axes[3].axhline(1.15, color="grey", linestyle=":", linewidth=1)
    for ax in axes[:3]:
        ax.set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("8 simulated H100 replicas (qwen2.5-32b cost model), shopper-session trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kill(plt: Any, kill: RunResult, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    # x: the centre of each arrival window, relative to the kill; requests in flight at the kill arrived
    # in the windows just before it (their retries show there).
    xs = [t + WINDOW_S / 2 - kill.extra["kill_at_s"] for t, _, _ in kill.extra["windows"]]
    ax.plot(xs, [m for _, m, _ in kill.extra["windows"]], marker=".", label="mean TTFT (ms)")
    ref = kill.extra.get("reference_windows") or []
    ax.plot(
        [t + WINDOW_S / 2 - kill.extra["kill_at_s"] for t, _, _ in ref], [m for _, m, _ in ref],
        color="grey", linestyle=":", label="same run, no kill",
    )  # fmt: skip
    ax.axvline(0, color="red", linewidth=1)
    ax.set(
        title="prefix_aware, 8 replicas, one SIGKILLed at t=0",
        xlabel="arrival (10 s window centre), s from the kill (simulated)",
        ylabel="mean TTFT per 10 s window (ms)",
    )
    hits = ax.twinx()
    hits.plot(
        xs, [100 * h for _, _, h in kill.extra["windows"]], color="green", marker=".", label="cache hit %"
    )
    hits.set(ylabel="cache hit (%)", ylim=(0, 100))
    ax.legend(loc="lower left")
    hits.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(tag: str) -> None:
    """Redraw the figures from the JSON of an earlier run."""
    fields = set(RunResult.__dataclass_fields__)

    def load(name: str) -> Any:
        path = RESULTS / name
        return json.loads(path.read_text()) if path.exists() else None

    sweep = load(f"routing{tag}.json")
    kill = load(f"routing{tag}_kill.json")
    results = [
        RunResult(**{k: v for k, v in r.items() if k in fields}) for r in (sweep or {}).get("results", [])
    ]
    kill_result = RunResult(**{k: v for k, v in kill["result"].items() if k in fields}) if kill else None
    plot(results, kill_result, RESULTS, tag)
