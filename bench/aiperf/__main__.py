"""``python -m bench.aiperf``: the gateway measured with NVIDIA's ``aiperf``, the client our users run.

Short form (``make bench-smoke``; a few tens of seconds once aiperf is installed)::

    python -m bench.aiperf --policies prefix_aware --rates 8 --conversations 4 --turns 2 --replicas 2

Full run (the table in ``docs/gateway.md``)::

    python -m bench.aiperf

For each policy and rate: fresh simulator replicas (``serving.simulator`` at its TensorRT-LLM-faithful
defaults, Qwen2.5-32B on an H100 each, sped up by ``--time-scale``), ``shopper router serve`` in front of
them, and one ``aiperf profile`` run through it: streamed chat, multi-turn conversations whose history
grows, one session id per conversation in ``x-session-id``, token counts from the server's usage. Prints
aiperf's TTFT and ITL (p50, p99) per cell, with the share of prompt tokens the replicas served from their
prefix cache, and writes ``aiperf_gateway.json`` (every cell's aiperf summary, the exact commands, the
printed table) under ``bench.common.results_dir()``.

aiperf runs from a virtualenv of its own, made and cached on first use (``bench.aiperf.install``), with
a tokenizer trained offline on aiperf's own corpus (``bench/aiperf/offline_tokenizer.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from bench.aiperf.cells import Cell, Workload, run_cell, shown_command
from bench.aiperf.install import AIPERF_VERSION, TOKENIZER_NAME, ensure_aiperf
from bench.aiperf.intervals import bootstrap_interval
from bench.common import machine, print_table, results_dir

RESULTS_FILE = "aiperf_gateway.json"
HEADERS = (
    "rate req/s", "policy", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
    "prompt cache read %", "achieved req/s",
)  # fmt: skip


def with_interval(value: float, samples: list[float], q: float, digits: int) -> str:
    """aiperf's percentile, then its bootstrap interval over the run's requests."""
    low, high = bootstrap_interval([v for v in samples if v == v], q)  # v == v: not NaN
    return f"{value:,.{digits}f} [{low:,.{digits}f}, {high:,.{digits}f}]"


def row(cell: Cell, summary: dict[str, Any]) -> list[object]:
    """One table row from aiperf's summary: its own percentiles (nothing recomputed), each with the
    interval of its run's requests (``bench.aiperf.intervals``)."""
    ttft, itl = summary["time_to_first_token"], summary["inter_token_latency"]
    samples = summary["per_request"]
    errors = sum(int(e.get("count", 0)) for e in summary.get("error_summary") or [])
    cache = summary.get("overall_usage_prompt_cache_read_pct", {}).get("avg", float("nan"))
    return [
        f"{cell.rate:g}",
        cell.policy,
        int(summary["request_count"]["avg"]),
        errors,
        with_interval(ttft["p50"], samples["ttft_ms"], 50, 0),
        with_interval(ttft["p99"], samples["ttft_ms"], 99, 0),
        with_interval(itl["p50"], samples["itl_ms"], 50, 1),
        with_interval(itl["p99"], samples["itl_ms"], 99, 1),
        f"{cache:.1f}",
        f"{summary['request_throughput']['avg']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policies", default="round_robin,prefix_aware,session_affinity", help="comma-separated"
    )
    parser.add_argument("--rates", default="6,12", help="requests/s, comma-separated (--request-rate)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--time-scale", type=float, default=0.5, help="simulator wall seconds per simulated second"
    )
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=1000, help="new user tokens a turn")
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    load = Workload(args.conversations, args.turns, args.input_tokens, args.output_tokens)
    cells = [Cell(p, float(r)) for r in args.rates.split(",") for p in args.policies.split(",")]

    aiperf = ensure_aiperf()
    print(f"machine: {machine()}; load average before: {os.getloadavg()[0]:.1f}")
    print(
        f"aiperf {AIPERF_VERSION} (tokenizer {TOKENIZER_NAME}); {args.replicas} simulator replicas at their "
        f"defaults, time scale {args.time_scale}; {load.conversations} conversations x {load.turns} turns, "
        f"{load.input_tokens} new tokens a turn, {load.output_tokens} out"
    )
    results: list[dict[str, Any]] = []
    rows: list[list[object]] = []
    for cell in cells:
        timeout_s = 120 + 4 * load.requests / cell.rate
        summary = asyncio.run(run_cell(aiperf, cell, load, args.replicas, args.time_scale, timeout_s))
        rows.append(row(cell, summary))
        print(f"{cell.policy} at {cell.rate:g} req/s: {dict(zip(HEADERS[2:], rows[-1][2:], strict=True))}")
        command = shown_command(cell, load)
        results.append({"policy": cell.policy, "rate": cell.rate, "command": command, "aiperf": summary})
    table = print_table(HEADERS, rows)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(
        json.dumps(
            {
                "machine": machine(),
                "args": vars(args),
                "aiperf_version": AIPERF_VERSION,
                "tokenizer": TOKENIZER_NAME,
                "cells": results,
                "table": table,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
