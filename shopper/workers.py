"""``shopper run --workers N``: N runner processes in one consumer group, one per core.

CPython runs one core per process; the consumer group is what spreads partitions (and so shoppers)
across processes, exactly as it spreads them across machines. Each worker writes its accounting; the
parent adds them up; a worker that fails or writes no report fails the command."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from pipeline.accounting import Accounting


def run_workers(count: int, args: list[str]) -> tuple[Accounting, int]:
    """Run the workers to the end; returns the summed accounting and how many workers failed."""
    with tempfile.TemporaryDirectory(prefix="shopper-workers-") as tmp:
        reports = [Path(tmp) / f"worker-{i}.json" for i in range(count)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "shopper", "run", *args, "--workers", "1", "--report", str(r)]
            )
            for r in reports
        ]

        def forward(signum: int, _frame: object) -> None:
            for proc in procs:
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for proc in procs:
                proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        totals = Accounting()
        for report in reports:
            if report.exists():
                data = json.loads(report.read_text())
                for field in fields(Accounting):
                    setattr(totals, field.name, getattr(totals, field.name) + data[field.name])
        failed = sum(
            1 for proc, report in zip(procs, reports, strict=True) if proc.returncode or not report.exists()
        )
        return totals, failed
