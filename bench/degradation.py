"""What the degradation detector's evaluation costs per answered call, by pool size: the client runs
``DegradationDetector.evaluate`` over a pool after every answered attempt (``Fleet.evaluate_health``),
so its cost is paid per request, and it grows with the pool.

    python -m bench.degradation [--sizes 3,8,16,32,64] [--rounds 5] [--baseline-tree DIR]

Each pool's replicas have 30 answers each at about the same latency (none drifts, as in a healthy
fleet: every replica is judged and none is drained, the common case). Each round times every size in a
fresh process of this tree and, with ``--baseline-tree`` (a ``git worktree`` of another commit), of
that tree, back to back, so a ratio is taken within a round. The table gives the median µs per
evaluation and the median ratio with its range over the rounds; results go to
``bench/results/degradation.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import orjson

from bench.common import load_average, machine, print_table, write_results

TIMING = """
import json, random, sys, time
from llm_client.degradation import DegradationDetector
from llm_client.endpoints import Endpoint
random.seed(1)
out = {}
for n in json.loads(sys.argv[1]):
    pool = [Endpoint(url=f"http://r{i}:8000", name=f"r{i}") for i in range(n)]
    detector = DegradationDetector()
    for endpoint in pool:
        for _ in range(30):
            detector.observe_success(
                endpoint, random.uniform(90, 110), prompt_tokens=3000, cached_tokens=2500,
                completion_tokens=96,
            )
    repeat = max(50, 20000 // (n * n))
    detector.evaluate(pool)
    started = time.perf_counter()
    for _ in range(repeat):
        detector.evaluate(pool)
    out[n] = (time.perf_counter() - started) / repeat * 1e6
print(json.dumps(out))
"""


def time_tree(tree: Path, sizes: list[int]) -> dict[int, float]:
    """µs per ``evaluate`` at each size, measured in a fresh interpreter importing ``tree``'s code."""
    done = subprocess.run(
        [sys.executable, "-c", TIMING, orjson.dumps(sizes).decode()],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return {int(n): us for n, us in orjson.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="3,8,16,32,64", help="pool sizes, comma separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-tree", type=Path, help="another commit's checkout to compare with")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    trees = {"this tree": Path.cwd()}
    if args.baseline_tree:
        trees[args.baseline_tree.name] = args.baseline_tree.resolve()
    load_before = list(os.getloadavg())
    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in trees}
    for round_index in range(args.rounds):
        order = list(trees.items()) if round_index % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            for n, us in time_tree(tree, sizes).items():
                runs[name][n].append(us)

    headers = ["replicas in the pool", *(f"{name}: µs per evaluate (median)" for name in trees)]
    if args.baseline_tree:
        headers.append(f"this tree ÷ {args.baseline_tree.name}, median [range] of {args.rounds} rounds")
    rows: list[list[object]] = []
    for n in sizes:
        row: list[object] = [n, *(f"{statistics.median(runs[name][n]):.1f}" for name in trees)]
        if args.baseline_tree:
            ratios = [
                a / b for a, b in zip(runs["this tree"][n], runs[args.baseline_tree.name][n], strict=True)
            ]
            row.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
        rows.append(row)
    print(machine())
    table = print_table(headers, rows)
    print(load_average())
    write_results(
        "degradation.json",
        {
            "args": {**vars(args), "baseline_tree": str(args.baseline_tree or "")},
            "load_average_start": load_before,
            "runs_us": {name: {str(n): v for n, v in by_size.items()} for name, by_size in runs.items()},
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
