"""No ``shopper`` command prints a secret, and no file it leaves holds one unless only its owner can
read it.

Every setting that can hold a secret gets its own distinctive value through the environment, as an
operator sets them: Redis passwords in a URL's user info and as ``?password=`` (a real ``redis-server``
with those passwords, so the Redis commands get through), Kafka SASL and SSL-key passwords (for the
runner and the Flink job), LLM API keys, LLM endpoint URLs with ``user:pass@``, S3 secret keys, the
gateway's and the real-time service's API keys. Then every command of the typer app, enumerated from
the app itself (a new command is run too, with no arguments), runs as its own process against the test
stack; each one either does its job or fails fast (a broker it cannot authenticate to, a port in use,
a Flink cluster that is not there), and its stdout and stderr are searched for every secret. Last,
every file under the state directory that holds a secret must be readable by its owner only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import typer

from devstack.flink_cluster import FlinkClusterState, cluster_state_file
from devstack.processes import free_port
from devstack.stack import StackState
from pipeline.redaction import MASK
from shopper.cli import app
from tests.conftest import Isolated
from tests.security_kit import _process, make_certificates

pytestmark = pytest.mark.timeout(600)

SECRET_PATHS = (
    "redis-default-password",  # STACK_REDIS_URL ...?password=  (default user)
    "redis-writer-password",  # SINK_REDIS_URL user:pass@       (ACL user)
    "redis-runner-password",  # RUNNER_SINKS__REDIS_URL ?username=&password=
    "kafka-sasl-password",
    "kafka-ssl-key-password",
    "flink-kafka-sasl-password",
    "flink-kafka-ssl-key-password",
    "llm-api-key",
    "runner-llm-api-key",
    "flink-llm-api-key",
    "stack-endpoint-password",
    "llm-endpoint-password",
    "runner-endpoint-password",
    "aws-secret-access-key",
    "sink-s3-secret",
    "runner-s3-secret",
    "flink-s3-secret",
    "gateway-api-key",
    "realtime-api-key",
)
PLANTED = {path: f"PLANTED-{path}-7f1e{uuid.uuid4().hex[:6]}" for path in SECRET_PATHS}

NOT_RUN = {
    ("flink", "up"): "starts two JVMs (about 2 GB); it prints only its local web URL and folders",
}
"""Commands not run here, each with the reason; every other command of the app is."""


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every leaf command under ``command`` (a group has ``commands``), as its path of names."""
    subcommands = getattr(command, "commands", None)
    if subcommands:
        for name, sub in subcommands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path


def _takes_state_dir(path: tuple[str, ...]) -> bool:
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return any(param.name == "state_dir" for param in command.params)


@pytest.fixture
def redis_with_passwords(tmp_path: Path) -> Iterator[int]:
    """A redis-server whose default user and two ACL users have planted passwords."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(tmp_path), "--requirepass", PLANTED["redis-default-password"],
        "--user", "writer", "on", ">" + PLANTED["redis-writer-password"], "~*", "&*", "+@all",
        "--user", "runner", "on", ">" + PLANTED["redis-runner-password"], "~*", "&*", "+@all",
    ]  # fmt: skip
    with _process(argv, port, tmp_path / "redis.log"):
        yield port


def _environment(isolated: Isolated, redis_port: int, certs_dir: Path) -> dict[str, str]:
    stack = isolated.stack
    certs = make_certificates(certs_dir)  # the client key is encrypted with another password
    redis = f"127.0.0.1:{redis_port}/0"
    moto = stack.s3_endpoint_url or ""
    sim = stack.llm_endpoints[0].split("://", 1)[1]

    def kafka(prefix: str, sasl: str, key: str) -> dict[str, str]:
        return {
            f"{prefix}PROTOCOL": "SASL_SSL",
            f"{prefix}SSL_CA_FILE": str(certs.ca),
            f"{prefix}SSL_CERT_FILE": str(certs.client_cert),
            f"{prefix}SSL_KEY_FILE": str(certs.client_key),
            f"{prefix}SSL_KEY_PASSWORD": PLANTED[key],
            f"{prefix}SASL_MECHANISM": "SCRAM-SHA-512",
            f"{prefix}SASL_USERNAME": "shopper-app",
            f"{prefix}SASL_PASSWORD": PLANTED[sasl],
        }

    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("STACK_", "SINK_", "RUNNER_", "FLINK_JOB_", "LLM_", "GATEWAY_", "REALTIME_"))
    }
    env.update(
        {
            "STACK_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
            "STACK_REDIS_URL": f"redis://{redis}?password={PLANTED['redis-default-password']}",
            "STACK_S3_ENDPOINT_URL": moto,
            "STACK_LLM_ENDPOINTS": json.dumps([f"http://stack:{PLANTED['stack-endpoint-password']}@{sim}"]),
            "AWS_ACCESS_KEY_ID": "AKIATESTEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": PLANTED["aws-secret-access-key"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "SINK_REDIS_URL": f"redis://writer:{PLANTED['redis-writer-password']}@{redis}",
            "SINK_S3_ENDPOINT_URL": moto,
            "SINK_S3_ACCESS_KEY_ID": "AKIATESTEXAMPLE",
            "SINK_S3_SECRET_ACCESS_KEY": PLANTED["sink-s3-secret"],
            "RUNNER_BOOTSTRAP_SERVERS": stack.kafka_bootstrap,
            "RUNNER_TOPIC": isolated.topic,
            "RUNNER_DLQ_TOPIC": isolated.dlq_topic,
            "RUNNER_SINKS__REDIS_URL": (
                f"redis://{redis}?username=runner&password={PLANTED['redis-runner-password']}"
            ),
            "RUNNER_SINKS__S3_ENDPOINT_URL": moto,
            "RUNNER_SINKS__S3_ACCESS_KEY_ID": "AKIATESTEXAMPLE",
            "RUNNER_SINKS__S3_SECRET_ACCESS_KEY": PLANTED["runner-s3-secret"],
            "RUNNER_LLM__ENDPOINTS": json.dumps(
                [f"http://runner:{PLANTED['runner-endpoint-password']}@{sim}"]
            ),
            "RUNNER_LLM__SECURITY__API_KEY": PLANTED["runner-llm-api-key"],
            **kafka("RUNNER_KAFKA_SECURITY__", "kafka-sasl-password", "kafka-ssl-key-password"),
            **kafka(
                "FLINK_JOB_KAFKA__SECURITY__", "flink-kafka-sasl-password", "flink-kafka-ssl-key-password"
            ),
            "FLINK_JOB_LLM__SECURITY__API_KEY": PLANTED["flink-llm-api-key"],
            "FLINK_JOB_SINKS__S3_SECRET_ACCESS_KEY": PLANTED["flink-s3-secret"],
            "LLM_ENDPOINTS": json.dumps([f"http://gw:{PLANTED['llm-endpoint-password']}@{sim}"]),
            "LLM_SECURITY__API_KEY": PLANTED["llm-api-key"],
            "GATEWAY_API_KEY": PLANTED["gateway-api-key"],
            "REALTIME_API_KEYS": json.dumps([PLANTED["realtime-api-key"]]),
            "BATCH_JOBS_PREFIX": f"jobs-{isolated.tag}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


COMPONENT_COMMANDS = ("router", "realtime", "batch")
"""Commands configured by the components' own names (``LLM_*``, ``SINK_*``); the others read the
engines' nested names (``RUNNER_LLM__*``, ``FLINK_JOB_SINKS__*``). One environment holding both names of
a setting is refused (``pipeline.setting_names``), so each family gets its own."""
NESTED_NAMES = ("RUNNER_LLM__", "RUNNER_SINKS__", "FLINK_JOB_LLM__", "FLINK_JOB_SINKS__")
OWN_NAMES = ("LLM_", "SINK_")


def _env_for(path: tuple[str, ...], env: dict[str, str]) -> dict[str, str]:
    drop = NESTED_NAMES if path[0] in COMPONENT_COMMANDS else OWN_NAMES
    return {key: value for key, value in env.items() if not key.startswith(drop)}


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 90.0) -> str:
    """Everything the command wrote, run as its own process (librdkafka writes to the real stderr,
    below Python); stopped after ``timeout_s``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "shopper", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return output.decode(errors="replace")


def _leaks(text: str) -> list[str]:
    return [path for path, secret in PLANTED.items() if secret in text]


def test_no_command_prints_a_secret_and_the_state_is_private(
    isolated: Isolated, redis_with_passwords: int, tmp_path: Path
) -> None:
    env = _environment(isolated, redis_with_passwords, tmp_path / "certs")
    state_dir = tmp_path / "state"
    busy_port = redis_with_passwords  # a server that must fail fast binds to a port in use
    extra: dict[tuple[str, ...], list[list[str]]] = {
        ("stack", "up"): [[]],
        ("produce",): [["--events", "5", "--topic", isolated.topic]],
        ("run",): [["--until-drained"], ["--until-drained", "--no-from-stack"]],
        ("signals",): [[]],
        ("tail-dlq",): [["--topic", isolated.dlq_topic]],
        ("demo",): [["--events", "5", "--shoppers", "1", "--keep-stack"]],
        ("batch", "submit"): [
            ["--input", "s3://shopper-understanding/none.jsonl", "--output", "s3://x/y", "--detach"]
        ],
        ("batch", "resume"): [["no-such-job", "--detach"]],
        ("batch", "cancel"): [["no-such-job"]],
        ("batch", "status"): [[], ["--no-from-stack"]],
        ("batch", "worker"): [[]],
        ("realtime", "serve"): [["--port", str(busy_port)], ["--port", str(busy_port), "--no-from-stack"]],
        ("router", "serve"): [["--port", str(busy_port)], ["--port", str(busy_port), "--from-stack"]],
        ("flink", "status"): [[]],
        ("flink", "submit"): [[]],
        ("flink", "down"): [[]],
        ("stack", "down"): [[]],
    }
    commands = list(_commands(typer.main.get_command(app)))
    assert ("stack", "up") in commands and ("router", "serve") in commands
    first, last = [("stack", "up")], [("flink", "down"), ("stack", "down")]
    order = first + [c for c in commands if c not in first + last and c not in NOT_RUN] + last

    leaks: dict[str, list[str]] = {}
    outputs: dict[str, str] = {}
    for path in order:
        for args in extra.get(path, [[]]):
            argv = [*path, *args]
            if _takes_state_dir(path):
                argv += ["--state-dir", str(state_dir)]
            output = _run(argv, _env_for(path, env))
            name = " ".join([*path, *args])
            outputs[name] = output
            if _leaks(output):
                leaks[name] = _leaks(output)
        if path == ("stack", "up"):
            state_path = state_dir / "stack.json"
            assert state_path.exists(), outputs["stack up"][-3000:]
            assert stat.S_IMODE(state_path.stat().st_mode) == 0o600, "the state file holds the passwords"
            state = StackState.from_json(state_path.read_text())
            assert PLANTED["redis-default-password"] in state.redis_url, "the state keeps what clients need"
            # A Flink cluster that is not there (its state names a FLINK_HOME without a flink binary),
            # so 'flink status/submit/down' run their real code and fail fast.
            cluster = FlinkClusterState(str(tmp_path / "no-flink"), free_port(), free_port())
            cluster_state_file(state_dir).parent.mkdir(parents=True, exist_ok=True)
            cluster_state_file(state_dir).write_text(json.dumps(asdict(cluster)))

    assert "kafka_bootstrap" in outputs["stack up"] and MASK in outputs["stack up"], outputs["stack up"]
    assert "runner config:" in outputs["run --until-drained"], outputs["run --until-drained"][-3000:]
    both_names = _run(["run", "--until-drained", "--no-from-stack"], env)  # LLM_* and RUNNER_LLM__* set
    assert "set under two names" in both_names and "RUNNER_LLM__ENDPOINTS and LLM_ENDPOINTS" in both_names
    if _leaks(both_names):
        leaks["run (both names)"] = _leaks(both_names)
        outputs["run (both names)"] = both_names
    assert '"endpoints"' in outputs[f"router serve --port {busy_port}"]
    assert leaks == {}, "\n\n".join(f"$ shopper {name}\n{outputs[name][-2000:]}" for name in leaks)

    world_readable = [
        (str(file.relative_to(tmp_path)), _leaks(file.read_text(errors="replace")))
        for file in (tmp_path / "state").rglob("*")
        if file.is_file() and stat.S_IMODE(file.stat().st_mode) & 0o077
    ]
    assert [entry for entry in world_readable if entry[1]] == [], "files others can read hold secrets"
    written = [file for file in state_dir.rglob("job-*.json")]
    assert written, "'flink submit' wrote its job config (secrets in clear, owner only)"
