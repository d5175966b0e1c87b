"""``wait_for_http`` takes a 200 for the child's only when the child lives and owns the listener: with
every replica's port chosen before any binds, a duplicate made one replica exit "address already in
use", and its sibling's answer on that port passed for its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.errors import StackError
from devstack.processes import free_port, spawn, stop, wait_for_http
from serving.simulator.launch import simulator_argv


def test_a_sibling_answering_on_the_childs_port_is_not_the_child(tmp_path: Path) -> None:
    port = free_port()
    first = spawn("sim-a", simulator_argv(port=port, replica_id="a"), port, tmp_path)
    try:
        wait_for_http(first, timeout_s=30)
        second = spawn("sim-b", simulator_argv(port=port, replica_id="b"), port, tmp_path)
        try:
            with pytest.raises(StackError, match="sim-b exited during start-up"):
                wait_for_http(second, timeout_s=30)
        finally:
            stop(second)
    finally:
        stop(first)
