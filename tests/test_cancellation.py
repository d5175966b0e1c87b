"""A test run stopped with SIGTERM (CI cancelling a job) stops the services its fixtures started
(``tests.cancellation``): a run of pytest of its own, whose session fixture starts a redis-server, is
sent SIGTERM mid-test; the server's port must be closed once the run has ended."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devstack.processes import port_open

REPO = Path(__file__).resolve().parents[1]

HELD_TEST = """
import time
from pathlib import Path

import pytest

from tests.fault_kit import OwnRedis


@pytest.fixture(scope="session")
def own_redis(tmp_path_factory):
    redis = OwnRedis(tmp_path_factory.mktemp("held"))
    redis.start()
    yield redis
    redis.stop()


def test_held(own_redis):
    Path({port_file!r}).write_text(str(own_redis.port))
    time.sleep(120)
"""


@pytest.mark.parametrize("plugin", ["tests.cancellation", None])
def test_a_run_stopped_with_sigterm_stops_what_its_fixtures_started(
    tmp_path: Path, plugin: str | None
) -> None:
    """With the plugin (what the suite loads, through tests/conftest.py) the server is stopped; without
    it, pytest's own behaviour, it is left running: the case the plugin is for."""
    port_file = tmp_path / "port"
    (tmp_path / "test_held.py").write_text(HELD_TEST.format(port_file=str(port_file)))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    argv += ["-p", plugin] if plugin else []
    run = subprocess.Popen(
        [*argv, str(tmp_path / "test_held.py")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    port = None
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0].decode()[-2000:]
            time.sleep(0.1)
        port = int(port_file.read_text())
        assert port_open(port)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0].decode()
        if plugin:
            assert run.returncode == pytest.ExitCode.INTERRUPTED, output[-2000:]
            assert not port_open(port), "the redis-server the fixture started still runs"
        else:
            assert run.returncode == -signal.SIGTERM and port_open(port)
    finally:
        if run.poll() is None:
            run.kill()
        if port is not None and port_open(port):  # the case without the plugin: stopped here
            subprocess.run(
                ["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, check=False
            )
