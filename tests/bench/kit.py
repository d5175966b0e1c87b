"""What the benchmark smoke tests share: running a bench script the way docs/ shows it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.common import REPO, RESULTS_DIR_ENV


def run_bench(argv: Sequence[str], results_dir: Path, timeout_s: float) -> tuple[int, str]:
    """``python argv`` from the repository root, its results written to ``results_dir``
    (``BENCH_RESULTS_DIR``) so a smoke run never touches the documented ones; its exit status and what
    it printed (stdout, then stderr)."""
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env={**os.environ, RESULTS_DIR_ENV: str(results_dir)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr
