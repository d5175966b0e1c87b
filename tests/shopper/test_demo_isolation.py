"""``shopper demo`` on a stack or broker that has seen events before, and its stack down when the shared
Redis no longer answers: the demo accounts for its own events only, and a Redis error at the end never
leaves its stack running."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from devstack.processes import free_port, port_open
from devstack.stack import StackSettings, stack_down, stack_up, state_file
from pipeline.topics import EVENTS_TOPIC
from shopper.demo import run_demo
from shopper.producer import produce
from tests.shopper.test_shopper_cli import processes_holding

pytestmark = pytest.mark.slow


def quiet_console(file: io.StringIO | None = None) -> Console:
    return Console(file=file or io.StringIO(), width=200, color_system=None)


def printed(console: Console) -> str:
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


@pytest.mark.parametrize("engine", ["embedded", pytest.param("flink", marks=pytest.mark.flink)])
def test_a_demo_on_a_stack_with_earlier_events_accounts_for_its_own_only(tmp_path: Path, engine: str) -> None:
    """The reviewer's scenario: ``stack up``, ``produce --malformed-rate 0.05``, then ``demo`` on that
    stack. The demo's new group (the runner's, or the Flink job's) read the earlier events too (the LLM
    paid again), and the demo counted their dead letters as its own: a mismatch, exit 1."""
    state_dir = tmp_path / "state"
    state = stack_up(StackSettings(state_dir=state_dir, replicas=3, time_scale=0.05))  # as the demo asks
    try:
        earlier = produce(
            state.kafka_bootstrap,
            EVENTS_TOPIC,
            events=300,
            shoppers=20,
            rate=None,
            malformed_rate=0.05,
            seed=3,
        )
        assert earlier.malformed > 0
        console = quiet_console()
        code = run_demo(state_dir, events=300, shoppers=20, keep_stack=False, console=console, engine=engine)
        out = printed(console)
        assert code == 0 and "all accounted for" in out, out[-4000:]
        assert "was up before the demo: left running" in out
    finally:
        stack_down(state_dir)


class StopsRedisAt(io.StringIO):
    """The demo's console output; once the demo says ``marker``, stops the shared Redis."""

    def __init__(self, marker: str, redis: subprocess.Popen[bytes]) -> None:
        super().__init__()
        self.marker, self.redis = marker, redis

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.redis.poll() is None and self.marker in self.getvalue():
            self.redis.terminate()
            self.redis.wait(timeout=30)
        return written


@dataclass
class OwnRedis:
    process: subprocess.Popen[bytes]
    url: str


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    """A redis-server of the test's own, outside any stack's state dir, for a stack to take as shared."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_open(port):
            assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield OwnRedis(process, f"redis://127.0.0.1:{port}/0")
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def test_the_demo_stops_its_stack_when_the_shared_redis_no_longer_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_redis: OwnRedis
) -> None:
    """Its stack down deleted the keys first: the Redis error raised out of it and left Tansu, moto, the
    simulators and the gateway running, and the state file, which the next demo took for the user's."""
    monkeypatch.setenv("STACK_REDIS_URL", own_redis.url)
    state_dir = tmp_path / "state"
    console = quiet_console(StopsRedisAt("5. stack down", own_redis.process))
    try:
        code = run_demo(state_dir, events=200, shoppers=10, keep_stack=False, console=console)
        out = printed(console)
        assert code == 0, out[-4000:]
        assert own_redis.process.poll() is not None, "the Redis was stopped before the stack down"
        assert "left this stack's keys" in out and "did not answer" in out, out[-2000:]
        assert not state_file(state_dir).exists()
        assert not processes_holding(state_dir), "the stack's processes outlived the demo"
    finally:
        stack_down(state_dir, clear_keys=False)
        for line in processes_holding(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
