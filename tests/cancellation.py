"""A cancelled test run stops what it started.

CI cancels a job (its time limit, a newer push) with SIGTERM. pytest tears its fixtures down on an
interrupt (``KeyboardInterrupt``) only, so on SIGTERM it died at once, and the embedded stack its
session fixtures had started (the Tansu broker, moto, the simulated replicas, a Flink cluster) ran on,
on a machine the next job shares. Here SIGTERM is an interrupt: the fixtures stop what they started,
and the run ends as interrupted (exit status 2). A second SIGTERM, while that teardown runs, kills.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one is not waited for
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
