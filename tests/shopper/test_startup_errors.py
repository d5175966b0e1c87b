"""A start that cannot work ends the ``shopper`` command with one line and a non-zero exit, not a
traceback: a Flink cluster that does not come up in time (``shopper flink up``), an S3 endpoint that is
no URL or where nothing answers (``shopper stack up``, ``shopper batch submit``, ``shopper run``). Each
runs the real console command (``python -m shopper``) in a process of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shopper.test_shopper_cli import one_line, processes_holding

REPO = Path(__file__).resolve().parents[2]
REFUSED = "http://127.0.0.1:1"
"""Nothing listens on port 1: the connection is refused at once."""
NOT_A_URL = "not a url"

S3_ENV = {
    # Credentials of no one (botocore signs before it connects) and one attempt: a refused endpoint
    # fails in about a second instead of after botocore's backoff.
    "AWS_ACCESS_KEY_ID": "AKIDSTARTUPERRORS",
    "AWS_SECRET_ACCESS_KEY": "startup-errors-not-a-secret",
    "AWS_MAX_ATTEMPTS": "1",
}


def shopper(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 120) -> tuple[int, str]:
    """``shopper argv`` as a user runs it; its exit status and its stdout and stderr together."""
    done = subprocess.run(
        [sys.executable, "-m", "shopper", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr


# ---- shopper flink up ------------------------------------------------------------------------------
STUB_JOBMANAGER = """
import http.server, json, os
import yaml
conf = yaml.safe_load(open(os.path.join(os.environ["FLINK_CONF_DIR"], "config.yaml")))
overview = json.dumps({"taskmanagers": 0, "slots-total": 0, "slots-available": 0}).encode()
class Overview(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(overview)))
        self.end_headers()
        self.wfile.write(overview)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(conf["rest"]["port"])), Overview).serve_forever()
"""

FAKE_JAVA = """#!/bin/bash
# Flink's scripts run java for their own config parsing (BashJavaUtils): the real one. The JobManager
# is a stub whose REST answers with no slots; a TaskManager never registers.
for arg in "$@"; do
    case "$arg" in
        org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint) exec {python} {stub} ;;
        org.apache.flink.runtime.taskexecutor.TaskManagerRunner) exec sleep 600 ;;
    esac
done
exec {java} "$@"
"""


def java_whose_taskmanagers_never_register(where: Path) -> Path:
    """A folder holding a ``java`` for Flink's scripts to find on ``PATH``: the cluster's JobManager
    answers its REST and no TaskManager ever registers a slot, so the start times out waiting for the
    slots, with no Flink JVM started."""
    java = shutil.which("java")
    if java is None:
        pytest.skip("no java: Flink's scripts need it to read their config")
    where.mkdir()
    (where / "stub_jobmanager.py").write_text(STUB_JOBMANAGER)
    fake = where / "java"
    fake.write_text(FAKE_JAVA.format(python=sys.executable, stub=where / "stub_jobmanager.py", java=java))
    fake.chmod(0o755)
    return where


@pytest.mark.slow
def test_flink_up_that_does_not_come_up_in_time_says_so_in_one_line_and_stops_what_it_started(
    tmp_path: Path,
) -> None:
    """The TaskManagers' slots not registered within the start timeout was a ``TimeoutError`` traceback
    (``FlinkRest.wait_for_slots``), after 120 s that no option could shorten."""
    fake_java = java_whose_taskmanagers_never_register(tmp_path / "bin")
    state_dir = tmp_path / "state"
    env = {"PATH": f"{fake_java}{os.pathsep}{os.environ['PATH']}", "JAVA_HOME": ""}
    argv = ["flink", "up", "--state-dir", str(state_dir), "--start-timeout", "20"]
    code, output = shopper(argv, env, tmp_path)
    left = processes_holding(state_dir)
    for line in left:  # not left behind for the next test, whatever the outcome
        subprocess.run(["kill", "-KILL", f"-{line.split(':')[0]}"], check=False)
    line = one_line(output)
    log_dir = state_dir / "flink" / "home" / "log"
    assert code == 1 and line.startswith("shopper: the Flink cluster did not come up"), output
    assert "TaskManager" in line and "within 20 s" in line and f"logs in {log_dir}" in line, line
    assert not left, f"processes outlived the failed start: {left}"
    assert not (state_dir / "flink" / "cluster.json").exists(), "no state of a cluster that is not up"


# ---- an S3 endpoint that cannot work -----------------------------------------------------------------
@pytest.mark.parametrize("endpoint", [NOT_A_URL, REFUSED])
def test_stack_up_with_an_s3_endpoint_that_cannot_work_says_so_in_one_line(
    tmp_path: Path, endpoint: str
) -> None:
    """``STACK_S3_ENDPOINT_URL`` that is no URL was botocore's ``ValueError: Invalid endpoint``, one where
    nothing answers its ``EndpointConnectionError``, both as tracebacks, after Tansu and Redis had been
    started (and stopped again). Now the first is refused as the settings are read and the second at the
    bucket's creation, before anything starts."""
    state_dir = tmp_path / "state"
    env = {"STACK_S3_ENDPOINT_URL": endpoint, **S3_ENV}
    code, output = shopper(["stack", "up", "--state-dir", str(state_dir)], env, tmp_path)
    line = one_line(output)
    assert code == 1 and "STACK_S3_ENDPOINT_URL" in line and endpoint in line, output
    assert not (state_dir / "stack.json").exists() and not (state_dir / "logs").exists(), "nothing started"


@pytest.mark.parametrize("endpoint", [NOT_A_URL, REFUSED])
def test_batch_submit_with_an_s3_endpoint_that_cannot_work_says_so_in_one_line(
    tmp_path: Path, endpoint: str
) -> None:
    """The job's registration is its first S3 call: it was botocore's traceback."""
    argv = ["batch", "submit", "--no-from-stack", "--input", "s3://in/a.jsonl", "--output", "s3://out/a"]
    code, output = shopper(argv, {"SINK_S3_ENDPOINT_URL": endpoint, **S3_ENV}, tmp_path)
    line = one_line(output)
    assert code == 1 and "SINK_" in line and "s3_endpoint_url" in line.lower() and endpoint in line, output


def test_run_with_an_s3_endpoint_that_is_no_url_says_so_before_it_starts(tmp_path: Path) -> None:
    """The runner took it and started, Kafka first: against a broker it stopped at the S3 sink's first
    client with botocore's ``ValueError: Invalid endpoint`` traceback (here, with none, it waited for
    one). Now it is refused as the settings are read."""
    env = {"RUNNER_SINKS__S3_ENDPOINT_URL": NOT_A_URL, "RUNNER_BOOTSTRAP_SERVERS": "127.0.0.1:1", **S3_ENV}
    code, output = shopper(["run", "--no-from-stack", "--until-drained"], env, tmp_path, timeout_s=60)
    line = one_line(output)
    assert code == 1 and "sinks.s3_endpoint_url" in line and NOT_A_URL in line, output


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"SINK_S3_ENDPOINT_URL": NOT_A_URL, **S3_ENV}, ("SINK_", "s3_endpoint_url")),
        ({"REALTIME_PORT": "not-a-port"}, ("REALTIME_", "port")),
        ({"LLM_ENDPOINTS": "not-json"}, ("LLM_", "endpoints")),
    ],
)
def test_realtime_serve_with_a_setting_that_cannot_work_says_so_in_one_line(
    tmp_path: Path, env: dict[str, str], names: tuple[str, ...]
) -> None:
    """``realtime serve --no-from-stack`` read ``SINK_*``, ``REALTIME_*`` and ``LLM_*`` unwrapped: a value
    refused was pydantic's dump of the input, in a traceback."""
    code, output = shopper(["realtime", "serve", "--no-from-stack"], env, tmp_path, timeout_s=60)
    line = one_line(output)
    assert code == 1 and all(name in line or name in line.lower() for name in names), output
    assert "Traceback" not in output, output


def test_realtime_serve_port_option_wins_over_a_bad_realtime_port(tmp_path: Path) -> None:
    """``--port`` given, ``REALTIME_PORT`` is not read: the settings after it (``SINK_*``, refused here
    so that nothing starts) are the first to fail."""
    env = {"REALTIME_PORT": "not-a-port", "SINK_S3_ENDPOINT_URL": NOT_A_URL, **S3_ENV}
    argv = ["realtime", "serve", "--no-from-stack", "--port", "0"]
    code, output = shopper(argv, env, tmp_path, timeout_s=60)
    line = one_line(output)
    assert code == 1 and "SINK_" in line and "REALTIME_" not in line, output


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BATCH_SHARD_RECORDS": "0"}, ("BATCH_", "shard_records")),
        ({"LLM_ENDPOINTS": "not-json"}, ("LLM_", "endpoints")),
    ],
)
def test_batch_status_with_a_setting_that_cannot_work_says_so_in_one_line(
    tmp_path: Path, env: dict[str, str], names: tuple[str, ...]
) -> None:
    """``batch ... --no-from-stack`` read ``BATCH_*`` and ``LLM_*`` unwrapped, as ``realtime serve`` did:
    a value refused was pydantic's dump of the input, in a traceback."""
    code, output = shopper(["batch", "status", "--no-from-stack"], env, tmp_path, timeout_s=60)
    line = one_line(output)
    assert code == 1 and all(name in line or name in line.lower() for name in names), output
    assert "Traceback" not in output, output
