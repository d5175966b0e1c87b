"""``python -m bench.aiperf`` in its short form: NVIDIA's aiperf, run from its own cached virtualenv with
the offline tokenizer, sends multi-turn conversations through ``shopper router serve`` to simulator
replicas, and the results say what aiperf measured.

The short form measures nothing (a handful of requests); it proves the documented command runs end to
end on this machine with no tokenizer download, that every request aiperf sent was answered, and that
the later turns carried the earlier ones' history through the gateway to a replica that held it (the
replicas report cached prompt tokens, which only a repeated prefix gives). A second test holds the
committed results to the code: each cell's command is what ``bench.aiperf`` would run for the recorded
arguments, so the command ``docs/gateway.md`` shows is the one that produced its numbers.

The first run on a machine installs aiperf (``bench.aiperf.install``: minutes, once); the fixture does
that before the timed run starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench.aiperf
from bench.aiperf.__main__ import RESULTS_FILE
from bench.aiperf.cells import Cell, Workload, shown_command
from bench.aiperf.install import INSTALL_TIMEOUT_S, AiperfInstall, ensure_aiperf
from bench.common import REPO
from tests.bench.kit import run_bench

pytestmark = pytest.mark.bench_smoke

POLICY = "prefix_aware"
RATE = "8"
CONVERSATIONS = 4
TURNS = 2
REPLICAS = 2
SHORT_FORM = (
    "-m", "bench.aiperf", "--policies", POLICY, "--rates", RATE, "--conversations", str(CONVERSATIONS),
    "--turns", str(TURNS), "--replicas", str(REPLICAS),
)  # fmt: skip
"""The short form the module's docstring shows (``bench/aiperf/__init__.py``)."""
HANG_GUARD_S = 300
"""Far over the short form's run once aiperf is installed (under a minute on a busy 2-core machine)."""


@pytest.fixture(scope="module")
def aiperf_installed() -> AiperfInstall:
    return ensure_aiperf()


def test_the_documented_short_form_is_the_one_run_here() -> None:
    docstring = bench.aiperf.__doc__ or ""
    assert "python " + " ".join(SHORT_FORM) in docstring


@pytest.mark.timeout(INSTALL_TIMEOUT_S + HANG_GUARD_S)
def test_aiperf_measures_multi_turn_conversations_through_the_gateway(
    aiperf_installed: AiperfInstall, tmp_path: Path
) -> None:
    returncode, output = run_bench(SHORT_FORM, tmp_path, HANG_GUARD_S)
    assert returncode == 0, output[-4000:]
    results = json.loads((tmp_path / RESULTS_FILE).read_text())
    (cell,) = results["cells"]
    summary: dict[str, Any] = cell["aiperf"]
    assert (cell["policy"], cell["rate"]) == (POLICY, float(RATE))
    assert summary["request_count"]["avg"] == CONVERSATIONS * TURNS, output[-2000:]
    assert not summary["error_summary"]
    assert summary["time_to_first_token"]["count"] == CONVERSATIONS * TURNS
    assert summary["inter_token_latency"]["p99"] > 0
    # turn 2 repeats turn 1 and its answer: the replica that computed turn 1 serves that prefix cached
    assert summary["total_usage_prompt_cache_read_tokens"]["avg"] > 0
    assert "|-" in results["table"]


def test_the_committed_results_hold_the_commands_that_produced_them() -> None:
    results = json.loads((REPO / "bench" / "results" / RESULTS_FILE).read_text())
    args = results["args"]
    load = Workload(args["conversations"], args["turns"], args["input_tokens"], args["output_tokens"])
    cells = {(c["policy"], c["rate"]) for c in results["cells"]}
    assert cells == {(p, float(r)) for p in args["policies"].split(",") for r in args["rates"].split(",")}
    for cell in results["cells"]:
        assert cell["command"] == shown_command(Cell(cell["policy"], cell["rate"]), load)
        assert cell["aiperf"]["aiperf_version"] == results["aiperf_version"]
        assert cell["aiperf"]["request_count"]["avg"] == load.requests
