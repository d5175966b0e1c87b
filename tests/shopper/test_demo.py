"""``make demo`` as the README runs it (``shopper demo``): an embedded stack of its own, the gateway
included, then produce, run until drained, report and stack down. It must end with everything
accounted for: a demo that failed went unnoticed once (a group id the repartition topic's name could
not hold), since the CLI tests only read what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_runs_end_to_end_and_accounts_for_everything(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "shopper", "demo", "--events", "600", "--shoppers", "20"]
    done = subprocess.run(
        [*command, "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert "all accounted for" in done.stdout
    assert "through the gateway" in done.stdout, "the runner calls the replicas through the stack's gateway"
    assert "stopped: " in done.stdout and "gateway" in done.stdout.rsplit("stopped: ", 1)[1]
