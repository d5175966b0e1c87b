"""The benchmarks' command lines: a ``--quick`` run writes beside the full run's results, never over
them, unless ``--out`` (``--tag`` for ``bench.routing``) says so; a name that matches nothing, an index
out of range and a contradictory combination are usage errors (exit 2, one message) before anything
starts.

Each ``main`` runs in this process with the part that would start a stack, a cluster or a benchmark
replaced by one that raises ``Started``: a check that stopped refusing fails here instead of running a
benchmark."""

from __future__ import annotations

import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import bench.batch as batch
import bench.disagg as disagg
import bench.flink_async as flink_async
import bench.kill_repay as kill_repay
import bench.overload as overload
import bench.realtime as realtime
import bench.routing.cli as routing_cli
import bench.runner as runner
from bench.common import RESULTS_DIR_ENV


class Started(Exception):
    """Raised where the benchmark would have started its work."""


def started(*_: object, **__: object) -> Any:
    raise Started


def run_main(monkeypatch: pytest.MonkeyPatch, main: Callable[[], object], argv: list[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    main()


def usage_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    main: Callable[[], object],
    argv: list[str],
) -> str:
    """``main`` with ``argv`` exits 2 before it starts anything; its message."""
    with pytest.raises(SystemExit) as exited:
        run_main(monkeypatch, main, argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---- --quick writes beside the full run's results --------------------------------------------------
RAN_WITH: list[Any] = []
"""The arguments a stand-in benchmark was handed, last one last."""


async def no_run(args: Any) -> dict[str, Any]:
    RAN_WITH.append(args)
    return {}


@pytest.mark.parametrize(
    ("argv", "written", "records"),
    [
        ([], ["batch.json", "batch.png"], (30_000, 8_000)),
        (["--quick"], ["batch_quick.json", "batch_quick.png"], (5_000, 2_000)),
        (["--quick", "--out", "batch"], ["batch.json", "batch.png"], (5_000, 2_000)),
        (["--quick", "--records", "123"], ["batch_quick.json", "batch_quick.png"], (123, 2_000)),
    ],
)
def test_batch_quick_writes_its_own_file_and_explicit_sizes_win(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    written: list[str],
    records: tuple[int, int],
) -> None:
    monkeypatch.setattr(batch, "RESULTS", tmp_path)
    monkeypatch.setattr(batch, "bench", no_run)
    monkeypatch.setattr(batch, "report", lambda result: None)
    monkeypatch.setattr(batch, "plot", lambda result, path: path.write_text("png"))
    run_main(monkeypatch, batch.main, argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    assert (RAN_WITH[-1].records, RAN_WITH[-1].baseline_records) == records


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        ([], "realtime.json"),
        (["--quick"], "realtime_quick.json"),
        (["--quick", "--out", "realtime"], "realtime.json"),
    ],
)
def test_realtime_quick_writes_its_own_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], written: str
) -> None:
    monkeypatch.setattr(realtime, "RESULTS", tmp_path)
    monkeypatch.setattr(realtime, "bench", no_run)
    monkeypatch.setattr(realtime, "report", lambda result: None)
    run_main(monkeypatch, realtime.main, argv)
    assert [p.name for p in tmp_path.iterdir()] == [written]


@pytest.mark.parametrize(
    ("argv", "phases"),
    [
        ([], (30.0, 20.0)),
        (["--quick"], (10.0, 10.0)),
        (["--quick", "--seconds", "3"], (3.0, 10.0)),
        (["--quick", "--overload-seconds", "2", "--seconds", "45"], (45.0, 2.0)),
        (["--seconds", "5"], (5.0, 20.0)),
    ],
)
def test_realtime_quick_presets_yield_to_explicit_phase_lengths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], phases: tuple[float, float]
) -> None:
    """``--quick`` used to set both phases to 10 s over a ``--seconds`` the command line gave."""
    monkeypatch.setattr(realtime, "RESULTS", tmp_path)
    monkeypatch.setattr(realtime, "bench", no_run)
    monkeypatch.setattr(realtime, "report", lambda result: None)
    run_main(monkeypatch, realtime.main, argv)
    assert (RAN_WITH[-1].seconds, RAN_WITH[-1].overload_seconds) == phases


class NoEndpoint:
    latency_s = 0.0

    def start(self) -> str:
        return "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        (["--rows", "17"], "flink_async.json"),
        (["--quick"], "flink_async_quick.json"),
        (["--quick", "--only", "100 ms"], "flink_async_quick.json"),
        (["--quick", "--out", "flink_async.json"], "flink_async.json"),
        (["--defaults"], "flink_async_defaults.json"),
    ],
)
def test_flink_async_quick_writes_its_own_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], written: str
) -> None:
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(flink_async, "FixedLatencyLLM", NoEndpoint)
    monkeypatch.setattr(
        flink_async, "run_once", lambda *_: {"rate": 1.0, "errors": 0, "p50": 1.0, "p99": 1.0, "n": 1}
    )
    run_main(monkeypatch, flink_async.main, argv)
    assert [p.name for p in tmp_path.iterdir()] == [written]


def test_disagg_quick_writes_its_own_file(tmp_path: Path) -> None:
    assert disagg.parse_args([]).out == disagg.RESULTS
    assert disagg.parse_args(["--quick"]).out == disagg.RESULTS_QUICK
    assert disagg.RESULTS_QUICK.parent == disagg.RESULTS.parent
    assert disagg.RESULTS_QUICK.name != disagg.RESULTS.name
    assert disagg.parse_args(["--quick", "--out", str(tmp_path / "m.json")]).out == tmp_path / "m.json"


def test_routing_quick_tags_its_files() -> None:
    assert routing_cli.parse_args([]).tag == ""
    assert routing_cli.parse_args(["--quick"]).tag == "_quick"
    assert routing_cli.parse_args(["--quick", "--tag", ""]).tag == ""
    assert routing_cli.parse_args(["--tag", "_x"]).tag == "_x"


@pytest.mark.parametrize(
    ("argv", "trace"),
    [
        ([], (200, "0.5,0.7,0.9", 6)),
        (["--quick"], (40, "0.7", 4)),
        (["--quick", "--shoppers", "10"], (10, "0.7", 4)),
        (["--quick", "--utilisations", "0.9", "--llama-shoppers", "2"], (40, "0.9", 2)),
        (["--shoppers", "80"], (80, "0.5,0.7,0.9", 6)),
    ],
)
def test_routing_quick_presets_yield_to_explicit_trace_sizes(
    argv: list[str], trace: tuple[int, str, int]
) -> None:
    """``--quick`` used to set 40 shoppers, one utilisation and 4 llama shoppers over what was given."""
    args = routing_cli.parse_args(argv)
    assert (args.shoppers, args.utilisations, args.llama_shoppers) == trace


# ---- usage errors before anything starts -----------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--only", "nomatch"], "matches no setting"),
        (["--quick", "--only", "nomatch"], "matches no setting of --quick"),
        (["--rows", "99"], "99 out of range"),
        (["--rows", "1,x"], "comma-separated integers"),
        (["--rows", "17", "--quick"], "--rows names the rows itself"),
        (["--rows", "17", "--defaults"], "--rows names the rows itself"),
        (["--defaults", "--quick"], "--defaults runs the job's two default rows"),
        (["--defaults", "--only", "bundle"], "--defaults runs the job's two default rows"),
        (["--bundle-ms", "100"], "--bundle-ms only applies with --defaults"),
        (["--defaults", "--bundle-ms", "0"], "positive milliseconds"),
    ],
)
def test_flink_async_refuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    monkeypatch.setattr(flink_async, "FixedLatencyLLM", started)
    assert says in usage_error(monkeypatch, capsys, flink_async.main, argv)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--setups", "2p6d-remote"],
            "no setup named 2p6d-remote; choose from agg, agg-chunked, 2P6D-remote",
        ),
        (["--quick", "--setups", "4P4D-idle"], "no setup named 4P4D-idle"),
        (["--workloads", "bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_disagg_refuses(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as exited:
        disagg.parse_args(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_disagg_documented_setups_parse() -> None:
    args = disagg.parse_args(
        ["--cost", "additive", "--cond-tokens", "128", "256", "--setups", "2P6D-cond128", "4P4D-cond256"]
    )
    assert args.setups == ["2P6D-cond128", "4P4D-cond256"]


@pytest.mark.parametrize("scenarios", ["ingset", ",", "ingest,typo"])
def test_runner_refuses_unknown_scenarios(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], scenarios: str
) -> None:
    monkeypatch.setattr(runner, "temporary_stack", started)
    monkeypatch.setattr(runner, "steps_table", started)
    message = usage_error(monkeypatch, capsys, runner.main, ["--scenarios", scenarios])
    assert "choose from ingest, llm0, paced, steps" in message


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--scenarios", "gatway"], "unknown gatway; choose from backlog, paced, gateway"),
        (["--scenarios", ","], "none given"),
        (["--scenarios", "gateway,gateway_paced"], "gateway_paced needs --rate"),
        (["--scenarios", "flink_gateway_paced"], "flink_gateway_paced needs --flink-rate"),
        (["--scenarios", "flink_prompts_paced", "--rate", "5"], "flink_prompts_paced needs --flink-rate"),
    ],
)
def test_kill_repay_refuses_before_the_stack_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    monkeypatch.setattr(kill_repay, "stack_up", started)
    monkeypatch.setattr(tempfile, "mkdtemp", started)
    assert says in usage_error(monkeypatch, capsys, kill_repay.main, argv)


def test_kill_repay_paced_scenarios_with_their_rates_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "mkdtemp", started)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # this process keeps its handler
    with pytest.raises(Started):
        run_main(
            monkeypatch,
            kill_repay.main,
            ["--scenarios", "gateway_paced,flink_gateway_paced", "--rate", "598", "--flink-rate", "60"],
        )


def test_overload_refuses_a_prompts_topic_without_flink(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(overload, "bench", started)
    for argv in (["--prompts-topic"], ["--engine", "runner", "--prompts-topic"]):
        assert "--prompts-topic needs --engine flink" in usage_error(monkeypatch, capsys, overload.main, argv)
    with pytest.raises(Started):
        overload.main(["--engine", "flink", "--prompts-topic"])
