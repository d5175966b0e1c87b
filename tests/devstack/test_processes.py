"""Stopping a started process stops its whole process group: a TaskManager's group leader is the
shell loop that restarts it, and once that shell exited on SIGTERM the stop returned while the rest
of the group (the JVM) ran on, never sent the SIGKILL."""

from __future__ import annotations

import os
import time
from pathlib import Path

from devstack.processes import group_alive, spawn, stop


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan this machine's init may not have reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_stop_kills_what_is_left_of_the_group_after_its_leader_exits(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    # The leader exits on SIGTERM; its child ignores SIGTERM, as a busy JVM may not stop in time.
    script = f"(trap '' TERM; exec sleep 60) & echo $! > {child_pid}; wait"
    process = spawn("group", ["bash", "-c", script], 0, tmp_path)
    deadline = time.monotonic() + 10
    while not child_pid.exists() or not child_pid.read_text().strip():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.02)
    child = int(child_pid.read_text())
    assert os.getpgid(child) == process.pid and group_alive(process.pid)
    stop(process, timeout_s=0.5)
    assert not running(child), "a member of the group outlived the stop"
    assert not group_alive(process.pid)
