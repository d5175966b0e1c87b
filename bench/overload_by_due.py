"""Freshness of the landed signals by when their prompts became due, from ``bench.overload --raw-dir``.

The overload table's "first → last third" compares the p99 of two 40 s thirds of the window. This
splits the window (and what became due after it, while the runner drained) into ``--bucket-s`` slices,
so a climb that goes on through the overload is told apart from one at its edge: when production
stops, no newer prompt supersedes the oldest ones still waiting within their budget, and they land.

    python -m bench.overload --arms latest_wins_priority --rates 2 --raw-dir /tmp/ovraw ...
    python -m bench.overload_by_due /tmp/ovraw/latest_wins_priority@2x.pickle [--bucket-s 10]
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

from bench import overload


class _OverloadUnpickler(pickle.Unpickler):
    """The pickles are written by ``python -m bench.overload``, so their classes are ``__main__``'s."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__":
            return getattr(overload, name)
        return super().find_class(module, name)


def _p(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def by_due(run: overload.Run, bucket_s: float) -> list[dict[str, Any]]:
    """Per ``bucket_s`` of due time from the window's start: landed insights, their freshness p50 and p99."""
    buckets: dict[int, list[float]] = {}
    for request_id, stored in run.stored.items():
        if stored.kind != "insight":
            continue
        launched = run.launched[request_id]
        at = int((launched.trigger_at - run.started) // bucket_s)
        buckets.setdefault(at, []).append(stored.stored_at - launched.trigger_at)
    return [
        {
            "due_from_s": at * bucket_s,
            "due_to_s": (at + 1) * bucket_s,
            "landed": len(ages),
            "p50": _p(ages, 0.5),
            "p99": _p(ages, 0.99),
        }
        for at, ages in sorted(buckets.items())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pickle", type=Path, help="a run's records, from bench.overload --raw-dir")
    parser.add_argument("--bucket-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    with args.pickle.open("rb") as f:
        run = _OverloadUnpickler(f).load()
    print(f"{run.arm} at {run.rate:g} events/s, window {run.seconds:g} s")
    print("| due (s from the window's start) | landed | freshness p50 / p99 s |")
    print("|---|---|---|")
    for row in by_due(run, args.bucket_s):
        p50, p99 = row["p50"], row["p99"]
        print(f"| {row['due_from_s']:g}-{row['due_to_s']:g} | {row['landed']} | {p50:.1f} / {p99:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
