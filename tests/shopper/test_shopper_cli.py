"""``shopper run`` takes its settings as the README says: defaults < environment < the embedded stack's
addresses < options given on the command line. An option left out never overrides the environment."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devstack.stack import StackState
from shopper.cli import main, runner_settings
from shopper.flink_cli import stack_job_settings
from sinks.config import SinkSettings


def test_environment_policy_and_group_hold_when_no_option_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RUNNER_LLM__POLICY", "prefix_aware")
    monkeypatch.setenv("RUNNER_GROUP_ID", "from-env")
    settings = runner_settings(
        from_stack=False, state_dir=tmp_path, until_drained=False, group_id=None, policy=None
    )
    assert settings.llm.policy == "prefix_aware"
    assert settings.group_id == "from-env"


def test_options_given_win_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RUNNER_LLM__POLICY", "prefix_aware")
    settings = runner_settings(
        from_stack=False, state_dir=tmp_path, until_drained=True, group_id="g", policy="round_robin"
    )
    assert (settings.llm.policy, settings.group_id, settings.until_drained) == ("round_robin", "g", True)


def test_stack_addresses_keep_the_environment_llm_settings(
    monkeypatch: pytest.MonkeyPatch, stack: StackState, stack_dir: Path
) -> None:
    monkeypatch.setenv("RUNNER_LLM__POLICY", "prefix_aware")
    monkeypatch.setenv("RUNNER_LLM__MAX_IN_FLIGHT", "7")
    settings = runner_settings(
        from_stack=True, state_dir=stack_dir, until_drained=False, group_id=None, policy=None
    )
    assert settings.llm.policy == "prefix_aware" and settings.llm.max_in_flight == 7
    assert settings.llm.endpoints == stack.stream_endpoints
    assert settings.bootstrap_servers == stack.kafka_bootstrap


@pytest.mark.parametrize("name", ["RUNNER_SINKS__REDIS_KEY_PREFIX", "SINK_REDIS_KEY_PREFIX"])
def test_a_key_prefix_from_the_environment_holds_while_the_runner_reads_the_stack(
    monkeypatch: pytest.MonkeyPatch, stack: StackState, stack_dir: Path, name: str
) -> None:
    """The README: the environment wins over the stack for anything but addresses, under either name."""
    monkeypatch.setenv(name, "probe:")
    settings = runner_settings(
        from_stack=True, state_dir=stack_dir, until_drained=False, group_id=None, policy=None
    )
    assert settings.sinks.redis_key_prefix == "probe:"
    assert settings.sinks.redis_url == stack.redis_url
    assert settings.sinks.s3_endpoint_url == stack.s3_endpoint_url


def test_stack_addresses_keep_the_environment_sink_settings(
    monkeypatch: pytest.MonkeyPatch, stack: StackState, stack_dir: Path
) -> None:
    monkeypatch.setenv("RUNNER_SINKS__ENABLED", '["redis"]')
    monkeypatch.setenv("RUNNER_SINKS__S3_PREFIX", "from-env")
    settings = runner_settings(
        from_stack=True, state_dir=stack_dir, until_drained=False, group_id=None, policy=None
    )
    assert settings.sinks.enabled == ("redis",) and settings.sinks.s3_prefix == "from-env"
    assert settings.sinks.s3_bucket == stack.s3_bucket


def test_without_a_prefix_in_the_environment_the_runner_writes_under_the_stacks_own(
    stack: StackState, stack_dir: Path
) -> None:
    settings = runner_settings(
        from_stack=True, state_dir=stack_dir, until_drained=False, group_id=None, policy=None
    )
    assert settings.sinks.redis_key_prefix == stack.redis_key_prefix
    assert stack.redis_key_prefix != SinkSettings().redis_key_prefix, "not the shared default"


@pytest.mark.parametrize("from_env", ["true", "false"])
def test_until_drained_from_the_environment_holds_unless_an_option_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, from_env: str
) -> None:
    """``RUNNER_UNTIL_DRAINED`` was overridden by the option's default (off) whether or not it was given."""
    monkeypatch.setenv("RUNNER_UNTIL_DRAINED", from_env)
    left_out = runner_settings(
        from_stack=False, state_dir=tmp_path, until_drained=None, group_id=None, policy=None
    )
    assert left_out.until_drained is (from_env == "true")
    for given in (True, False):
        settings = runner_settings(
            from_stack=False, state_dir=tmp_path, until_drained=given, group_id=None, policy=None
        )
        assert settings.until_drained is given


def run_cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    """``shopper argv`` as the console script runs it (``main``): its exit status and stderr."""
    monkeypatch.setattr("sys.argv", ["shopper", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    return int(exited.value.code or 0), capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_command_without_a_stack_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, err = run_cli(["signals", "--state-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 1 and one_line(err).startswith("shopper: no stack state at "), err


def test_an_unreadable_stack_state_says_what_to_do_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for written in ("{not json", '{"kafka_bootstrap": "x"}'):
        (tmp_path / "stack.json").write_text(written)
        code, err = run_cli(["tail-dlq", "--state-dir", str(tmp_path)], capsys, monkeypatch)
        line = one_line(err)
        assert code == 1 and "cannot be read" in line and "shopper stack up" in line, err


def test_an_unreadable_flink_cluster_state_says_what_to_do_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flink down`` on a cluster state that is not JSON ended in a JSONDecodeError traceback."""
    (tmp_path / "flink").mkdir()
    (tmp_path / "flink" / "cluster.json").write_text("{not json")
    code, err = run_cli(["flink", "down", "--state-dir", str(tmp_path)], capsys, monkeypatch)
    line = one_line(err)
    assert code == 1 and "Flink cluster state" in line and "cannot be read" in line, err


def test_a_section_variable_that_is_not_json_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNNER_LLM__ENDPOINTS", "not json")
    code, err = run_cli(["run", "--no-from-stack"], capsys, monkeypatch)
    line = one_line(err)
    assert code == 1 and "RUNNER_LLM__*" in line and "not json" not in line, err


def test_a_redis_that_does_not_answer_is_one_line_without_its_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SINK_REDIS_URL", "redis://:hunter2secret@127.0.0.1:1/0")
    code, err = run_cli(["signals", "--no-from-stack", "someone"], capsys, monkeypatch)
    line = one_line(err)
    assert code == 1 and line.startswith("shopper: Redis: ") and "hunter2secret" not in err, err


def test_a_flink_config_that_sets_part_of_a_section_keeps_the_stacks_addresses(
    stack: StackState, stack_dir: Path, tmp_path: Path
) -> None:
    """``shopper flink submit --config``: a file that set one field of ``kafka``, ``sinks`` or ``llm``
    replaced the whole section, and the job ran against the defaults' addresses (``kafka:9092``)."""
    config = tmp_path / "job.json"
    config.write_text(
        '{"kafka": {"group_id": "g"}, "sinks": {"redis_key_prefix": "x:"}, "llm": {"model": "other"}}'
    )
    settings = stack_job_settings(stack_dir, config)
    assert (settings.kafka.group_id, settings.sinks.redis_key_prefix, settings.llm.model) == (
        "g",
        "x:",
        "other",
    )
    assert settings.kafka.bootstrap_servers == stack.kafka_bootstrap
    assert settings.sinks.redis_url == stack.redis_url
    assert settings.llm.endpoints == stack.stream_endpoints


def processes_holding(directory: Path) -> list[str]:
    """The processes with a file under ``directory`` open (the stack's processes write their logs
    there), as ``pid: argv``."""
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(link.startswith(str(directory)) for link in links):
            holders.append(f"{entry.name}: {argv}")
    return holders


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stack_up_stopped_with_sigterm_stops_what_it_had_started(tmp_path: Path, stop_signal: int) -> None:
    """SIGTERM ended ``shopper stack up`` at once, and the processes it had started ran on, recorded
    nowhere (the state file is written at the end). Taken as Ctrl-C, the start's clean-up stops them;
    and Ctrl-C itself, raised inside the fork of a process, left that one running unrecorded."""
    state_dir = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "shopper", "stack", "up", "--state-dir", str(state_dir)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not list((state_dir / "logs").glob("*.log")):  # the first process has started
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()[0].decode()[-2000:]
            time.sleep(0.05)
        up.send_signal(stop_signal)
        output = up.communicate(timeout=60)[0].decode()
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode != 0 and not (state_dir / "stack.json").exists(), output[-2000:]
    left = processes_holding(state_dir)
    for line in left:  # not left behind for the next test, whatever the outcome
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(line.split(":")[0]), signal.SIGKILL)
    assert not left, f"processes outlived the interrupted start: {left}"
