"""Stopping a started process stops its whole process group: a TaskManager's group leader is the
shell loop that restarts it, and once that shell exited on SIGTERM the stop returned while the rest
of the group (the JVM) ran on, never sent the SIGKILL."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from devstack.errors import StackError
from devstack.processes import free_port, group_alive, listens_in_group, reused, spawn, stop, wait_for_port
from devstack.processes import running as running_record


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


def test_a_port_another_process_took_is_not_taken_for_the_childs(tmp_path: Path) -> None:
    """``free_port`` found the port free, another process took it before the child bound it: the child
    exits ("address already in use") and the start says so, instead of the stack using whatever
    listens there."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        port = foreign.getsockname()[1]
        redis_server = shutil.which("redis-server")
        assert redis_server is not None
        process = spawn("redis-taken", [redis_server, "--port", str(port), "--save", ""], port, tmp_path)
        try:
            with pytest.raises(StackError, match="exited during start-up"):
                wait_for_port(process, timeout_s=10)
        finally:
            stop(process)


def test_a_childs_own_listener_is_waited_for_and_recognised(tmp_path: Path) -> None:
    port = free_port()
    redis_server = shutil.which("redis-server")
    assert redis_server is not None
    process = spawn("redis-own", [redis_server, "--port", str(port), "--save", ""], port, tmp_path)
    try:
        wait_for_port(process, timeout_s=10)
        assert listens_in_group(process.pid, port) is True
        assert listens_in_group(os.getpgid(0), port) is False, "not the test's own group"
    finally:
        stop(process)


def test_a_recorded_pid_that_now_names_another_process_is_neither_up_nor_stopped(tmp_path: Path) -> None:
    """A state file outlives its processes (a reboot, a crash), and the system gives their PIDs to
    others. A record whose PID now names another process reads as down, and a stop sends it nothing:
    before, ``stack status`` said up, ``stack up`` reused a stack that was gone, and ``stack down``
    sent SIGTERM and SIGKILL to the group of whatever process held the PID now."""
    ours = spawn("ours", ["sleep", "60"], 0, tmp_path)
    time.sleep(0.05)  # a start time counts clock ticks (10 ms): a later one, as a reused PID's always is
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # not the stack's
    try:
        assert ours.started is not None and running_record(ours)
        # The record as a state file would hold it once ``ours`` was gone and its PID given to ``other``.
        stale = dataclasses.replace(ours, pid=other.pid)
        assert reused(stale) and not running_record(stale)
        stop(stale, timeout_s=0.5)
        assert other.poll() is None, "the stop signalled a process that was never the stack's"
        stop(ours, timeout_s=0.5)
        assert not running_record(ours) and not running(ours.pid)
    finally:
        other.kill()
        other.wait()
