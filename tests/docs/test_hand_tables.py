"""Tables in ``docs/`` that are still written by hand, checked number by number against the results file
they come from (or, for the simulator's KV memory and roofline tables and the sizing model, the code that
computes them).

A table between ``bench:table`` markers is generated (``test_bench_tables``). Some topic docs quote the
same runs in tables of their own shape, written by hand; until they are generated too, this test reads
each such table, takes every number of each checked cell, and compares it with the results file at the
precision the doc shows (``9.1`` passes for 9.13, ``41`` for 41.11; ``41`` does not pass for 42.0). A
cell that is prose (a run's label, "1-6, following the load") is not checked. A rerun that overwrites a
results file without updating the doc fails here, as does a hand edit."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.common import REPO
from bench.disagg import GPUS as DISAGG_GPUS
from bench.disagg import SLOS, SetupResult, goodput
from bench.report import load_setups
from bench.routing.stats import Aggregate, RunResult, aggregate
from bench.sizing import Inputs, size
from serving.simulator.cost_model import IterationWork
from serving.simulator.hardware import GPUS, WeightDtype, kv_memory
from serving.simulator.roofline import RooflineCost

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
Cell = float | tuple[float, ...] | None
"""What a checked cell holds: one number, several in their order ("138 / 1,156"), or None: not checked."""


@dataclass(frozen=True)
class HandTable:
    doc: str
    header: str
    """The table's first line starts with this."""
    results: tuple[str, ...]
    rows: Callable[[Sequence[dict[str, Any]]], list[list[Cell]]]
    """The expected cells of each row, from the results files' payloads."""


def doc_rows(doc: Path, header: str, after: str = "") -> list[list[str]]:
    """The body rows of the one table that starts with ``header`` (the first after the line that
    starts with ``after``, where the header repeats)."""
    lines = doc.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(after)) if after else 0
    starts = [i for i, line in enumerate(lines) if line.startswith(header) and i > first]
    start = starts[0] if after else starts[0] if len(starts) == 1 else -1
    assert start >= 0, f"{doc}: {len(starts)} tables start with {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def mismatches(written: str, expected: Cell) -> str | None:
    """Why ``written`` does not show ``expected`` at its own precision, or None when it does."""
    if expected is None:
        return None
    wanted = expected if isinstance(expected, tuple) else (expected,)
    shown = NUMBER.findall(written)
    if len(shown) != len(wanted):
        return f"{written!r}: {len(shown)} numbers, the results give {len(wanted)} ({wanted})"
    for text, value in zip(shown, wanted, strict=True):
        decimals = len(text.split(".")[1]) if "." in text else 0
        if f"{float(text.replace(',', '')):.{decimals}f}" != f"{value:.{decimals}f}":
            return f"{written!r}: {text} against {value:.{decimals}f} in the results"
    return None


# ---- the expected cells, one function per table ---------------------------------------------------------
def realtime_pair(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    before, after = payloads
    rows: list[list[Cell]] = []
    for old, new in zip(before["phases"], after["phases"], strict=True):
        for phase in (old, new):
            refused: Cell = (phase["refused"], phase["refused_late"]) if phase["refused"] else None
            rows.append(
                [
                    None,
                    None,
                    phase["requests"],
                    phase["errors"],
                    refused,
                    (phase["late"], 100 * phase["late"] / phase["requests"]),
                    phase["degraded_pct"],
                    (phase["overhead_p50_ms"], phase["overhead_p99_ms"]),
                    phase["cpu_ms_per_request"]["service"],
                ]
            )
    return rows


def _skew_runs(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in payload["results"] if r["setup"] == "skew"}


def chunked_prefill(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    """The chunked-prefill table of ``docs/routing.md``: the rows whose runs have a results file, in the
    doc's order; the two equal-progress rows of runs stopped after ``skew`` have none (the doc says so)."""
    unchunked, fcfs, pending, reuse = (_skew_runs(p) for p in payloads)
    no_file: list[Cell] = [None] * 6

    def row(runs: dict[str, dict[str, Any]], baselines: bool = True) -> list[Cell]:
        aware = runs["prefix_aware"]
        return [
            None,
            runs["round_robin"]["server_ttft_p99_ms"] if baselines else None,
            runs["least_outstanding"]["server_ttft_p99_ms"] if baselines else None,
            aware["server_ttft_p99_ms"],
            aware["prefill_tokens"] / aware["oracle_prefill_tokens_per_shopper"],
            aware["restarts_detected"],
        ]

    return [row(unchunked), row(fcfs), no_file, no_file, row(pending, baselines=False), row(reuse)]


def _pooled(payload: dict[str, Any], policy: str) -> Aggregate:
    fields = set(RunResult.__dataclass_fields__)
    runs = [RunResult(**{k: v for k, v in r.items() if k in fields}) for r in payload["results"]]
    (found,) = [a for a in aggregate(runs) if a.policy == policy]
    return found


def router_levers(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    """The router levers tried on ``skew`` (``docs/routing.md``): each row's pooled p99 with its bootstrap
    interval and replays, and prefill over the oracle (``stats.aggregate`` of its results file)."""
    default, queue_cap, if1, if05, hot, *noguard = payloads
    rows: list[list[Cell]] = []
    d = _pooled(default, "prefix_aware")
    rows.append([None, None, (d.p99, d.repeats), d.prefill_vs_oracle, None])
    q = _pooled(queue_cap, "prefix_aware")
    rows.append([None, None, (q.p99, q.repeats), q.prefill_vs_oracle, None])
    for payload in (if1, if05):
        a = _pooled(payload, "prefix_aware")
        rows.append([None, None, (a.p99, *a.p99_ci, a.repeats), a.prefill_vs_oracle, None])
    guards = [_pooled(payload, "prefix_aware_noguard") for payload in noguard]
    p99s = tuple(v for a in guards for v in (a.p99, *a.p99_ci))
    rows.append([None, None, (*p99s, guards[0].repeats), tuple(a.prefill_vs_oracle for a in guards), None])
    h = _pooled(hot, "prefix_aware")
    rows.append([None, None, (h.p99, *h.p99_ci, h.repeats), h.prefill_vs_oracle, None])
    return rows


def sizing_model(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    """``docs/sizing.md``'s model at its three rates, from ``bench.sizing.size`` at the default inputs."""
    del payloads
    rows: list[list[Cell]] = []
    for rate in (100_000, 1_000_000, 10_000_000):
        s = size(rate, Inputs())
        rows.append(
            [rate, s.prompts_per_s, s.gpus, s.partitions, s.runner_processes, s.flink_slots, s.kafka_mb_per_s,
             s.redis_writes_per_s, s.redis_gib, s.s3_objects_per_hour]
        )  # fmt: skip
    return rows


def kv_memory_table(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    """``docs/simulator.md``'s KV memory per model, GPU and weight type: computed by
    ``hardware.kv_memory``, not read from a results file (``max_num_tokens`` 8192, as the doc says)."""
    del payloads
    rows: list[list[Cell]] = []
    dtypes: tuple[WeightDtype, ...] = ("bf16", "fp8")
    for model, gpu, dtype in itertools.product(("qwen2.5-32b", "llama3-8b"), GPUS, dtypes):
        m = kv_memory(model, gpu, dtype, "auto", free_gpu_memory_fraction=0.9, tokens_per_block=32,
                      max_num_tokens=8192)  # fmt: skip
        rows.append(
            [None, None, None, m.weight_bytes / 1e9, m.activation_bytes / 1e9, m.kv_bytes_per_token, m.blocks,
             m.tokens]
        )  # fmt: skip
    return rows


def roofline_steps(payloads: Sequence[dict[str, Any]]) -> list[list[Cell]]:
    """``docs/simulator.md``'s roofline column for the default replica (Qwen2.5-32B, bf16, H100), from
    ``roofline.RooflineCost``; the eager table's column is checked by the cost model's own tests."""
    del payloads
    cost = RooflineCost.for_hardware("qwen2.5-32b", "h100-80gb", "bf16", "bf16")
    return [
        [None, tuple(cost.prefill_ms(n) for n in (256, 1024, 2048, 4096, 8192)), None],
        [None, cost.prefill_ms(256, 4096), None],
        [None, tuple(cost.decode_step_ms(b, b * 2048) for b in (1, 8, 16, 32, 64)), None],
        [None, cost.iteration_ms(IterationWork(((2000, 0),), 32, 32 * 2500)), None],
    ]


HAND_TABLES = [
    HandTable(
        "docs/realtime.md",
        "| phase | service | requests | errors | refused (late) |",
        ("realtime_before_25nov.json", "realtime_25nov.json"),
        realtime_pair,
    ),
    HandTable(
        "docs/routing.md",
        "| engine (`--engine-options`) |",
        (
            "routing_scenarios_p3_unchunked.json",
            "routing_scenarios_p3_fcfs2048.json",
            "routing_scenarios_p3_ep1024.json",
            "routing_scenarios_p6_ep1024_reuse.json",
        ),
        chunked_prefill,
    ),
    HandTable(
        "docs/routing.md",
        "| change | command option |",
        (
            "routing_scenarios_r2_skew.json",
            "routing_scenarios_p4_q2048.json",
            "routing_scenarios_p5_if1.json",
            "routing_scenarios_p5_if05.json",
            "routing_scenarios_p7_hot025.json",
            "routing_scenarios_p8_noguard.json",
            "routing_scenarios_p8_noguard_evict.json",
            "routing_scenarios_p8_noguard_burst.json",
        ),
        router_levers,
    ),
    HandTable("docs/sizing.md", "| events/s | LLM calls/s |", (), sizing_model),
    HandTable("docs/simulator.md", "| model | GPU | weights |", (), kv_memory_table),
    HandTable("docs/simulator.md", "| step | roofline ms |", (), roofline_steps),
]


# ---- docs/disaggregation.md: ladder goodput tables, matched by workload, cost and setup --------------
@dataclass(frozen=True)
class DisaggTable:
    header: str
    results: str
    cost: str | None
    """The cost model when the table has no cost column."""
    after: str = ""
    """The table is the first with its header after a line that starts with this."""


DISAGG_TABLES = [
    DisaggTable(
        "| workload | cost | setup | TTFT≤1 s, ITL≤150 ms |",
        "disagg_matrix.json",
        None,
        after="Run on 2026-11-23 on this machine (2 cores), beside a full `make test`.",
    ),
    DisaggTable("| workload | setup | TTFT≤1 s, ITL≤150 ms |", "disagg_idle.json", "additive"),
]


def disagg_cell_wrong(written: str, result: SetupResult, ttft_slo: float, itl_slo: float) -> str | None:
    """A ladder cell shows the goodput per GPU, and where it has brackets, the p99 TTFT interval and the
    p99 ITL (or its interval) at that rung."""
    best = goodput(result, ttft_slo, itl_slo)
    if best is None:
        return mismatches(written, 0.0)
    rung = best.rate / DISAGG_GPUS
    lo, hi = best.ttft_ci
    choices: list[Cell] = [rung, (rung, lo, hi, best.itl_p99), (rung, lo, hi, *best.itl_ci)]
    reasons = [mismatches(written, choice) for choice in choices]
    return None if None in reasons else reasons[1]


@pytest.mark.parametrize("table", DISAGG_TABLES, ids=lambda t: t.results)
def test_a_hand_written_goodput_table_shows_its_ladders_numbers(table: DisaggTable) -> None:
    found = load_setups(REPO / "bench" / "results" / table.results)
    results = {(r.workload, r.cost, r.setup): r for r in found}
    wrong = []
    rows = doc_rows(REPO / "docs" / "disaggregation.md", table.header, table.after)
    for cells in rows:
        workload, *rest = cells
        cost, setup_cell, *columns = rest if table.cost is None else [table.cost, *rest]
        base, *more = setup_cell.replace("*", "").split(" / ")
        setups = [base] + [base.rsplit("-", 1)[0] + extra for extra in more]
        for setup in setups:
            result = results[(workload, cost, setup)]
            for cell, (ttft_slo, itl_slo) in zip(columns, SLOS, strict=True):
                if (why := disagg_cell_wrong(cell, result, ttft_slo, itl_slo)) is not None:
                    wrong.append(f"{workload} {cost} {setup} TTFT≤{ttft_slo:g} ITL≤{itl_slo:g}: {why}")
    assert rows and not wrong, "\n".join(wrong)


@pytest.mark.parametrize("table", HAND_TABLES, ids=lambda t: f"{t.doc}:{t.header.split('|')[1].strip()}")
def test_a_hand_written_table_shows_its_results_files_numbers(table: HandTable) -> None:
    payloads = [json.loads((REPO / "bench" / "results" / name).read_text()) for name in table.results]
    expected = table.rows(payloads)
    written = doc_rows(REPO / table.doc, table.header)
    assert len(written) == len(expected), (table.doc, len(written), len(expected))

    wrong = [
        f"row {i + 1}: {why}"
        for i, (cells, wanted) in enumerate(zip(written, expected, strict=True))
        for cell, value in zip(cells, wanted, strict=True)
        if (why := mismatches(cell, value)) is not None
    ]
    assert not wrong, f"{table.doc} differs from its results:\n" + "\n".join(wrong)


def test_the_check_catches_a_changed_number() -> None:
    assert mismatches("9.1 / 190", (9.13, 190.26)) is None
    assert mismatches("41 / 187", (41.11, 187.12)) is None
    assert mismatches("2,781 (47.5%)", (2781, 47.55)) is None
    assert mismatches("42 / 187", (41.11, 187.12)) is not None
    assert mismatches("10 of 12,449", (10, 12450)) is not None
    assert mismatches("1-6, following the load", None) is None
