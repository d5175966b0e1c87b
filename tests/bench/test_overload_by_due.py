"""``python -m bench.overload_by_due``: freshness by due time, from a run's records as
``bench.overload --raw-dir`` pickles them (from ``__main__``, as ``python -m bench.overload`` runs)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from bench import overload

REPO = Path(__file__).resolve().parents[2]


def _run() -> overload.Run:
    """Twenty insights due 0.5 s apart over a 10 s window, each 1 s fresh, except the last two, 9 s."""
    run = overload.Run(arm="latest_wins_priority", rate=10.0, seconds=10.0, started=1000.0)
    for n in range(20):
        due = 1000.0 + n * 0.5
        request_id = f"s{n}:1:1"
        run.launched[request_id] = overload.Launched(f"s{n}", (1, 1), "add_to_cart", due, due, None)
        run.stored[request_id] = overload.Stored("insight", due + (9.0 if n >= 18 else 1.0))
    run.stored["s0:1:2"] = overload.Stored("superseded", 1005.0, cause="stale")
    run.launched["s0:1:2"] = overload.Launched("s0", (1, 2), "browse_pause", 1004.0, 1004.0, None)
    return run


def _by_due(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench.overload_by_due`` on ``path``, which must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.overload_by_due", str(path), *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_it_splits_the_landed_signals_by_when_they_became_due(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(_run()))
    done = _by_due(path, "--bucket-s", "5")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "-" in line.split("|")[1]]
    assert rows == ["| 0-5 | 10 | 1.0 / 1.0 |", "| 5-10 | 10 | 1.0 / 9.0 |"], done.stdout


def test_it_reads_records_pickled_from_main(tmp_path: Path) -> None:
    """What ``python -m bench.overload --raw-dir`` writes names its classes ``__main__.Run`` etc."""
    script = (
        "import pickle, sys\n"
        "from bench import overload\n"
        "import tests.bench.test_overload_by_due as t\n"
        "run = t._run()\n"
        "for cls in (overload.Run, overload.Launched, overload.Stored):\n"
        "    cls.__module__ = '__main__'\n"
        "    setattr(sys.modules['__main__'], cls.__name__, cls)\n"
        f"open({str(tmp_path / 'main.pickle')!r}, 'wb').write(pickle.dumps(run))\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=120)
    assert b"__main__" in (tmp_path / "main.pickle").read_bytes()
    done = _by_due(tmp_path / "main.pickle")
    assert "| 0-10 | 20 | 1.0 / 9.0 |" in done.stdout
