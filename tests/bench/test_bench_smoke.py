"""Every benchmark command ``docs/`` shows starts on a fresh clone: each one runs here in a short form
against the embedded parts (Tansu, Redis, moto, simulator replicas as subprocesses) and must exit 0 and
write its results file, or print its table where it writes none.

Nothing ran the benchmarks before, so a documented command could break unnoticed: ``python -m
bench.routing --quick`` started its simulators with ``bench/`` on their path once ``bench/`` became a
package (they imported ``bench/prompt_assembly.py`` as ``prompt_assembly`` and exited before READY), and
``python -m bench.runner`` handed the runner's ``error_cb`` to ``json.dumps``. A short form measures
nothing; it only proves the command still runs, end to end, through the same code as the long one.

Each run writes under a temporary ``BENCH_RESULTS_DIR`` (``bench.common.results_dir``), so the committed
results ``docs/`` cites are never overwritten. ``make bench-smoke`` runs this module alone; ``make test``
collects it with the rest.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.common import REPO
from tests.bench.kit import run_bench

RESULTS = REPO / "bench" / "results"
"""The committed results docs/ cites; only ever read here."""

pytestmark = pytest.mark.bench_smoke

HANG_GUARD_S = 300
"""A run that has not ended by then is stuck (the longest short form takes about a minute on a busy
2-core machine)."""


@dataclass(frozen=True)
class SmokeRun:
    """One documented command in a short form, and what it must leave behind."""

    name: str
    argv: tuple[str, ...]
    """After the interpreter: ``-m bench.x ...``, or the script path where docs/ shows a script."""
    results: tuple[str, ...] = ()
    """Files the run writes under ``BENCH_RESULTS_DIR``; none: it prints its table instead."""
    prints: str = "|-"
    """What its output must hold where it writes no results: a table's rule line, by default."""
    inputs: tuple[str, ...] = ()
    """Committed results copied into ``BENCH_RESULTS_DIR`` first, for a command that reads earlier results
    (so it also proves they still load)."""
    hang_guard_s: int = HANG_GUARD_S
    """When a run that has not ended is taken to be stuck."""

    @property
    def module(self) -> str:
        if self.argv[0] == "-m":
            return self.argv[1]
        return self.argv[0].removesuffix(".py").replace("/", ".")


SMOKE_RUNS = (
    SmokeRun("runner", ("-m", "bench.runner", "--events", "500", "--shoppers", "50", "--repeats", "1",
                        "--freshness-events", "40"), ("runner.json",)),
    SmokeRun("prompt_assembly", ("-m", "bench.prompt_assembly", "--events", "2000", "--shoppers", "50"),
             ("prompt_assembly.json",)),
    SmokeRun("client_overhead", ("-m", "bench.client_overhead", "--rate", "200", "--seconds", "1",
                                 "--rounds", "1"), ("client_overhead.json",)),
    SmokeRun("answer_parsing", ("-m", "bench.answer_parsing", "--tokens", "50", "--repeat", "20", "--rounds",
                                "2"), ("answer_parsing.json",)),
    SmokeRun("degradation", ("-m", "bench.degradation", "--sizes", "3,8", "--rounds", "1"),
             ("degradation.json",)),
    SmokeRun("security", ("-m", "bench.security", "--events", "500", "--repeat", "1"), ("security.json",)),
    SmokeRun("sizing", ("-m", "bench.sizing",)),
    SmokeRun("batch", ("-m", "bench.batch", "--records", "200", "--baseline-records", "100", "--skip-kill"),
             ("batch.json", "batch.png")),
    SmokeRun("realtime", ("-m", "bench.realtime", "--rate", "50", "--seconds", "3", "--overload-seconds",
                          "2", "--shoppers", "50"), ("realtime.json",)),
    SmokeRun("capacity", ("-m", "bench.capacity", "--seconds", "12", "--batch-records", "500",
                          "--shoppers", "50"), ("capacity.json", "capacity.png")),
    SmokeRun("handoff", ("-m", "bench.handoff", "--batch-calls", "4", "--repeats", "1", "--handoff-s", "0.5",
                         "--window-s", "1"), ("handoff.json",)),
    SmokeRun("gateway", ("-m", "bench.gateway", "--policies", "prefix_aware", "--rate", "10",
                         "--seconds", "2", "--shoppers", "10"),
             ("gateway.json",)),
    # bench/aiperf/__init__.py's short form (tests/bench/test_aiperf_smoke.py checks what aiperf measured)
    SmokeRun("aiperf", ("-m", "bench.aiperf", "--policies", "prefix_aware", "--rates", "8", "--conversations",
                        "4", "--turns", "2", "--replicas", "2"), ("aiperf_gateway.json",)),
    # --quick's code path with fewer shoppers (--quick sets 40): the setups, not the trace, are under test
    SmokeRun("routing", ("-m", "bench.routing", "--setups", "sim", "--utilisations", "0.7", "--policies",
                         "prefix_aware", "--shoppers", "10", "--replicas", "2", "--time-scale", "0.1"),
             ("routing.json", "routing.png")),
    SmokeRun("routing_replot", ("-m", "bench.routing", "--replot"), ("routing.png", "routing_kill.png"),
             inputs=("routing.json", "routing_kill.json")),
    SmokeRun("routing_combine", ("-m", "bench.routing", "--tag", "_smoke", "--combine",
                                 ",".join(str(RESULTS / f"routing_scenarios_r3_{s}.json")
                                          for s in ("base", "restart"))),
             ("routing_scenarios_smoke.json",)),
    SmokeRun("regions_mixed", ("-m", "bench.regions", "--scenario", "mixed", "--policies", "predicted_ttft",
                               "--rates", "6", "--seconds", "3"),
             ("regions_mixed.json",)),
    SmokeRun("regions_surge", ("-m", "bench.regions", "--scenario", "surge", "--rates", "6", "--seconds",
                               "4"), ("regions_surge.json",)),
    SmokeRun("regions_lost", ("-m", "bench.regions", "--scenario", "lost", "--lose", "west", "--surge", "1",
                              "--rates", "6", "--seconds", "4"), ("regions_lost_west.json",)),
    # the search's code path, stopped after its first bracket (tolerance 1.5: 4 and 8 are close enough)
    SmokeRun("disagg", ("-m", "bench.disagg", "--workloads", "ours", "--setups", "agg-chunked", "4P4D-idle",
                        "--requests", "10", "--search", "4", "8", "--repeats", "1", "--tolerance", "1.5"),
             ("disagg_matrix.json",)),
    SmokeRun("fidelity", ("-m", "bench.fidelity", "--short"), ("fidelity_short.json",)),
    SmokeRun("tokenizer_digits", ("-m", "bench.tokenizer_digits", "--events", "2000", "--shoppers", "50"),
             ("tokenizer_digits.json",)),
    # the capacity probe, then each policy at 1x; a given capacity would skip the probe's code path
    SmokeRun("overload", ("-m", "bench.overload", "--seconds", "6", "--rates", "1", "--probe-seconds", "10",
                          "--probe-shoppers", "300", "--grace", "2", "--age-samples", "10"),
             ("overload.json",)),
    # on a P/D fleet (one context and one generation replica behind a pd_aware gateway), a given capacity
    SmokeRun("overload_pd", ("-m", "bench.overload", "--replicas", "2", "--context-replicas", "1",
                             "--capacity", "2", "--seconds", "6", "--rates", "1", "--arms",
                             "latest_wins_priority", "--grace", "2", "--age-samples", "10",
                             "--out", "overload_pd.json"),
             ("overload_pd.json",)),
    # the Flink job's form: a given capacity, one arm at 1x on a one-TaskManager cluster; it waits out
    # a job submission and, after the stream, a browse pause and a rate limit (every pending trigger fires)
    SmokeRun("overload_flink", ("-m", "bench.overload", "--engine", "flink", "--replicas", "1", "--capacity",
                                "2", "--seconds", "6", "--rates", "1", "--arms", "latest_wins_priority",
                                "--grace", "2", "--age-samples", "10", "--out", "overload_flink.json"),
             ("overload_flink.json",), hang_guard_s=600),
    # the same with the job's prompts topic, enriched by a runner with input 'prompts'
    SmokeRun("overload_flink_prompts_topic",
             ("-m", "bench.overload", "--engine", "flink", "--prompts-topic", "--replicas", "1", "--capacity",
              "2", "--seconds", "6", "--rates", "1", "--arms", "latest_wins_priority", "--grace", "2",
              "--age-samples", "10", "--out", "overload_flink_pt.json"),
             ("overload_flink_pt.json",), hang_guard_s=600),
    # not a benchmark, but docs/ shows it: the docs' generated tables checked against their results
    SmokeRun("report", ("-m", "bench.report"), prints=": ok"),
    SmokeRun("tansu_fetch", ("-m", "bench.tansu_fetch", "--seconds", "4", "--waits", "100")),
    # docs/ shows the script form; one setting: the job's EnrichPrompts over HTTP, paced at two loads
    SmokeRun("flink_async", ("bench/flink_async.py", "--rows", "17", "--seconds", "1",
                             "--paced-seconds", "1", "--paced-load", "0.5,0.9"), ("flink_async.json",)),
    # a standalone Flink cluster (two TaskManagers): a small backlog through the job, then the runner; and
    # the recovery run, its TaskManager killed after the first checkpoint. Each waits out a job submission
    # (`flink run` compiles the plan in a JVM and Python: 35-50 s here), so they get a longer guard. The
    # recovery benchmark broke once unnoticed (it expected one TaskManager after the cluster got two).
    SmokeRun("flink_cluster", ("-m", "bench.flink_cluster", "--seconds", "0", "--backlog", "100"),
             ("flink_cluster.json",), hang_guard_s=600),
    # near each variant's own ceiling: a saturated run, then one paced load, the prompts topic's runner a
    # process of its own (python -m devstack.enrichment_stage)
    SmokeRun("flink_cluster_near_ceiling", ("-m", "bench.flink_cluster", "--loads", "0.5", "--ceiling-events",
                                             "300", "--seconds", "18", "--variants", "prompts_topic=on",
                                             "--out", "flink_near.json"),
             ("flink_near.json",), hang_guard_s=600),
    SmokeRun("flink_recovery", ("-m", "bench.flink_recovery", "--rate", "5", "--seconds", "20",
                                "--kill-after", "12"), ("flink_recovery.json",), hang_guard_s=600),
    # the backlog arm through a gateway (the stack's default path), one repeat: a clean run, then one
    # SIGKILLed mid-stream and restarted until drained
    SmokeRun("kill_repay", ("-m", "bench.kill_repay", "--events", "400", "--shoppers", "30", "--repeats", "1",
                            "--scenarios", "gateway"), ("kill_repay.json",)),
)  # fmt: skip


NOT_SMOKED: dict[str, str] = {
    "bench.overload_by_due": "reads the records a bench.overload run keeps with --raw-dir, which no "
    "committed result holds; tests/bench/test_overload_by_due.py runs it on records it builds",
}
"""Documented benchmarks no short form exists for, and why (also in docs/benchmarks.md)."""


DOCUMENTED = re.compile(r"python3? -m (bench\.[a-z_]+)|python3? (bench/[a-z_]+\.py)")


def documented_benchmarks() -> set[str]:
    """Every benchmark module a command in README.md or docs/ runs (``python -m bench.x``, or the
    script form ``python bench/x.py``)."""
    found: set[str] = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for module, script in DOCUMENTED.findall(doc.read_text()):
            found.add(module or script.removesuffix(".py").replace("/", "."))
    return found


def test_every_documented_benchmark_has_a_short_form_or_a_reason() -> None:
    covered = {run.module for run in SMOKE_RUNS} | set(NOT_SMOKED)
    missing = sorted(documented_benchmarks() - covered)
    assert not missing, f"documented benchmarks with no smoke run here: {missing}"
    assert not set(NOT_SMOKED) & {run.module for run in SMOKE_RUNS}


@pytest.mark.parametrize("run", SMOKE_RUNS, ids=lambda run: run.name)
def test_documented_benchmark_runs_and_writes_its_results(run: SmokeRun, tmp_path: Path) -> None:
    for name in run.inputs:
        shutil.copy(RESULTS / name, tmp_path / name)
    returncode, output = run_bench(run.argv, tmp_path, run.hang_guard_s)
    assert returncode == 0, f"{' '.join(run.argv)} exited {returncode}:\n{output[-4000:]}"
    written = sorted(path.name for path in tmp_path.iterdir())
    for name in run.results:
        assert name in written, f"{' '.join(run.argv)} wrote {written}, not {name}:\n{output[-2000:]}"
        path = tmp_path / name
        assert path.stat().st_size > 0
        if path.suffix == ".json":
            assert json.loads(path.read_text()), f"{name} is empty"
    if not run.results:
        assert run.prints in output, f"{' '.join(run.argv)} printed no {run.prints!r}:\n{output[-2000:]}"


def test_runner_ingest_alone_writes_its_results_and_leaves_runner_json_as_it_was(tmp_path: Path) -> None:
    """``--scenarios ingest`` against the embedded parts, with a documented ``runner.json`` already in
    ``BENCH_RESULTS_DIR``: the comparison lands in ``runner_ingest.json`` (what docs/benchmarks.md renders
    it from) and ``runner.json`` keeps its table. It was written over with an empty table before."""
    shutil.copy(RESULTS / "runner.json", tmp_path / "runner.json")
    before = (tmp_path / "runner.json").read_bytes()
    short = ["--events", "300", "--shoppers", "30", "--repeats", "1"]
    returncode, output = run_bench(
        ["-m", "bench.runner", "--scenarios", "ingest", *short], tmp_path, HANG_GUARD_S
    )
    assert returncode == 0, output[-4000:]
    assert (tmp_path / "runner.json").read_bytes() == before, "runner.json was written over"
    ingest = json.loads((tmp_path / "runner_ingest.json").read_text())
    assert "| bare consumer + orjson decode | 300" in ingest["table"]
    assert "| runner (this tree)" in ingest["table"]
    assert json.loads(before)["table"], "the committed runner.json has a table to keep"
