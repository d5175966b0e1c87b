"""A failed test that ran on the Flink cluster reports what the cluster's logs said about its Kafka sink.

A Flink test that fails in CI often fails by a consequence (a topic not readable to its end, a result
missing) far from its cause in the JobManager or a TaskManager (a commit refused, a transaction left
open, a checkpoint declined). The logs live on the CI machine only, so the report carries the lines that
say which: warnings and errors, and the Kafka sink's transaction and commit lines.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from pathlib import Path

import pytest

from devstack.processes import ManagedProcess, alive

FLINK_LOG_LINES = 60
"""The newest matching lines kept, over all the cluster's logs."""

_WORTH_REPORTING = re.compile(r" (WARN|ERROR) |connector\.kafka\.sink|[Ss]avepoint|Decline")
_NOISE = re.compile(r"Name collision|Flushing new partitions")
"""Said at every checkpoint of every run: they would crowd out the lines that differ."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    cluster = getattr(item, "funcargs", {}).get("flink_cluster")
    if report.when == "call" and report.failed and cluster is not None:
        text = f"{process_summary(cluster.processes)}\n{flink_log_excerpt(cluster.log_dir)}"
        report.sections.append(("Flink processes, then logs (sink, commits, warnings)", text))
    return report


def process_summary(processes: list[ManagedProcess]) -> str:
    """One line per cluster process, first in the report (a CI log keeps the head of a section): alive
    or not; for a TaskManager, how often its loop restarted it and whether it registered since; its
    output's last line. So a TaskManager that never came back after a kill is named as such."""
    lines = []
    for process in processes:
        log = Path(process.log)
        text = log.read_text(errors="replace") if log.exists() else ""
        last = (text.strip().splitlines() or ["(no output)"])[-1][:200]
        state = "alive" if alive(process.pid) else "dead"
        if "taskmanager" in process.name:
            since_restart = text.rsplit("TaskManager exited with status", 1)[-1]
            registered = "Successful registration at resource manager" in since_restart
            restarts = text.count("TaskManager exited with status")
            state += f", {restarts} restart(s), {'registered' if registered else 'NOT registered'}"
        lines.append(f"{process.name} (pid {process.pid}): {state}; last line: {last}")
    return "\n".join(lines)


def flink_log_excerpt(log_dir: Path, lines: int = FLINK_LOG_LINES) -> str:
    """The newest ``lines`` lines worth reporting of every ``*.log`` under ``log_dir``, in time order
    (each line starts with its timestamp), each once (a process's log4j file and its captured output
    hold the same lines) and prefixed with the first file that has it."""
    found: dict[str, str] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            stamped = line[:1].isdigit()  # not a stack trace's "at ..." lines: they sort out of time order
            if stamped and _WORTH_REPORTING.search(line) and not _NOISE.search(line):
                found.setdefault(line[:400], path.name)
    newest = sorted(found)[-lines:]
    return "\n".join(f"{found[line]}: {line}" for line in newest) or f"no matching lines under {log_dir}"
