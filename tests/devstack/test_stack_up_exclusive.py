"""One stack per state dir: ``shopper stack up`` stopped by a dropped SSH session (SIGHUP) stops what it
had started; two at once on one state dir make one stack (``stack_lock``), not two with one recorded;
and one asking for another stack than the one up is refused, not handed the one up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shopper import test_shopper_cli as cli_tests

ONE_REPLICA = ["--replicas", "1", "--no-gateway"]


def shopper(state_dir: Path, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """``shopper stack ARGS --state-dir STATE_DIR`` in a process of its own, to its end."""
    argv = [sys.executable, "-m", "shopper", "stack", *args, "--state-dir", str(state_dir)]
    return subprocess.run(argv, cwd=state_dir.parent, capture_output=True, text=True, timeout=timeout_s)


def stopped_leftovers(state_dir: Path) -> list[str]:
    """``stack down``, then the processes still holding a file of ``state_dir`` (killed: not left behind
    for the next test)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        shopper(state_dir, "down", timeout_s=60)
    left = cli_tests.processes_holding(state_dir)
    for line in left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(line.split(":")[0]), signal.SIGKILL)
    return left


@pytest.mark.slow
def test_stack_up_stopped_with_sighup_stops_what_it_had_started(tmp_path: Path) -> None:
    """An SSH session that drops sends SIGHUP: it ended ``stack up`` at once, its children (sessions of
    their own) ran on, recorded nowhere. The SIGTERM test's body, with SIGHUP."""
    cli_tests.test_stack_up_stopped_with_sigterm_stops_what_it_had_started(tmp_path, signal.SIGHUP)


@pytest.mark.slow
def test_two_stack_ups_on_one_state_dir_start_one_stack(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    argv = [sys.executable, "-m", "shopper", "stack", "up", "--state-dir", str(state_dir), *ONE_REPLICA]
    ups = [
        subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    try:
        outputs = [up.communicate(timeout=180)[0].decode()[-2000:] for up in ups]
    finally:
        for up in ups:
            if up.poll() is None:
                up.kill()
        left = stopped_leftovers(state_dir)
    assert [up.returncode for up in ups] == [0, 0], outputs
    assert not left, f"processes outlived 'stack down': {left}"


@pytest.mark.slow
def test_stack_up_asking_for_another_stack_is_refused_in_one_line(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    try:
        first = shopper(state_dir, "up", *ONE_REPLICA)
        assert first.returncode == 0, first.stderr[-2000:]
        again = shopper(state_dir, "up", *ONE_REPLICA)
        assert (again.returncode, again.stdout) == (0, first.stdout), "the same options: the stack up"
        other = shopper(state_dir, "up", "--replicas", "2", "--no-gateway")
    finally:
        left = stopped_leftovers(state_dir)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 1 and len(lines) == 1, other.stderr
    assert lines[0] == (
        f"shopper: a stack with 1 sim replicas is up in {state_dir}, started with other settings "
        "(replicas: 1 there, 2 asked); run 'shopper stack down' first"
    )
    assert not left, f"processes outlived 'stack down': {left}"
