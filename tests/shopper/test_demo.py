"""``make demo`` as the README runs it (``shopper demo``): an embedded stack of its own, the gateway
included, then produce, run until drained, report and stack down. It must end with everything
accounted for: a demo that failed went unnoticed once (a group id the repartition topic's name could
not hold), since the CLI tests only read what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devstack.enrichment_stage import running_enrichment
from devstack.flink_cluster import cluster_state_file
from devstack.processes import alive
from devstack.stack import load_state, stack_down

pytestmark = pytest.mark.slow


def run_demo(tmp_path: Path, *options: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``shopper demo`` on 600 events of 20 shoppers, with a stack (and a state dir) of its own."""
    command = [sys.executable, "-m", "shopper", "demo", *options, "--events", "600", "--shoppers", "20"]
    return subprocess.run(
        [*command, "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=tmp_path,
    )


def test_the_demo_runs_end_to_end_and_accounts_for_everything(tmp_path: Path) -> None:
    done = run_demo(tmp_path, timeout_s=300)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert "all accounted for" in done.stdout
    assert "through the gateway" in done.stdout, "the runner calls the replicas through the stack's gateway"
    assert "stopped: " in done.stdout and "gateway" in done.stdout.rsplit("stopped: ", 1)[1]


@pytest.mark.flink
def test_the_flink_demo_runs_the_job_and_its_enrichment_runner_and_accounts_for_everything(
    tmp_path: Path,
) -> None:
    """``shopper demo --engine flink``: a standalone cluster of its own, the job at its defaults (its
    prompts handed to the enrichment runner ``submit`` starts beside it), a drain, and every prompt
    stored before the runner is stopped; nothing of either left running."""
    done = run_demo(tmp_path, "--engine", "flink", timeout_s=540)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert "enrichment runner on shopper-prompts" in done.stdout
    assert "every prompt answered and stored" in done.stdout and "all accounted for" in done.stdout
    # The JobManager, the TaskManagers and the enrichment runner all run from the demo's state dir.
    left = subprocess.run(["pgrep", "-af", str(tmp_path / "state")], capture_output=True, text=True)
    assert left.returncode == 1, f"processes outlived the demo: {left.stdout}"
    assert not cluster_state_file(tmp_path / "state").exists() and not running_enrichment(tmp_path / "state")


def test_the_demo_leaves_a_stack_the_user_had_up_running(tmp_path: Path) -> None:
    """``shopper demo`` reuses a stack that is up in its state dir (``shopper stack up``'s default,
    ``.state``): it then stopped that stack and deleted its keys, the user's results among them."""
    state_dir = tmp_path / "state"
    up = subprocess.run(
        [sys.executable, "-m", "shopper", "stack", "up", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    try:
        before = load_state(state_dir)
        done = run_demo(tmp_path, timeout_s=300)
        assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
        assert "was up before the demo: left running" in done.stdout and "stopped: " not in done.stdout
        assert all(alive(p.pid) for p in before.processes)
        assert load_state(state_dir).processes == before.processes
    finally:
        stack_down(state_dir)
