"""What real-time calls meet on a replica just handed over from batch: batch's calls on it cut a
disconnect poll before real time takes it (``withdraw``, what the capacity followers do), cut at that
instant (``at_join``), or left to finish (``keep``, how it was before), and a replica batch never used
(``idle``, the reference).

    python -m bench.handoff [--batch-calls 128] [--repeats 3] [--handoff-s 2] [--window-s 5]

Two simulated H100 replicas at the simulator's faithful defaults (time scale 1: real seconds), as child
processes. Batch keeps ``--batch-calls`` calls a replica in flight (closed loop, the batch pool's
default budget of 128, its client settings: least outstanding, no streaming), each a ~1,500-token
document asking for 300 tokens. Once it is steady, r0 moves to real time: batch drops it at once, with
its calls still there withdrawn as the arm says or kept, and real time (the real-time service's
client settings) routes to it from ``--handoff-s`` on, sending a ranking-sized call (~900 tokens in, 30
out) every 0.2 s for ``--window-s``. The table gives the real-time calls' latency over that window,
batch's answers in it, and what the cut costs: calls withdrawn, their prompt tokens paid again.
Each repeat runs the four arms on fresh replicas, the order rotating. Results:
``bench/results/handoff.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal

from batch.config import BatchSettings
from batch.launch import batch_client_config
from bench.common import load_average, machine, percentile, print_table, write_results
from capacity.pool import ABORT_NOTICE_S
from llm_client import LLMClient
from llm_client.errors import LLMError
from prompt_assembly.tokens import count_tokens
from realtime.service import realtime_client_config
from serving.simulator.launch import SimulatorFleet

MODEL = "simulated"
Mode = Literal["withdraw", "at_join", "keep", "idle"]
MODES: tuple[Mode, ...] = ("withdraw", "at_join", "keep", "idle")
ARM_NAMES = {
    "withdraw": "withdrawn a disconnect poll before the join (default)",
    "at_join": "withdrawn at the join",
    "keep": "left to finish (before)",
    "idle": "none (batch never used it)",
}
WORDS = (
    "soft",
    "cotton",
    "jersey",
    "dress",
    "pockets",
    "washable",
    "relaxed",
    "fit",
    "crew",
    "neck",
    "sleeves",
)
BATCH_DOCUMENT_WORDS = 1500
"""About 1,500 tokens as the simulator counts them (``prompt_assembly.tokens``: a word a token here)."""
BATCH_MAX_TOKENS = 300
RANKING_WORDS = 900
RANKING_MAX_TOKENS = 30
RANKING_EVERY_S = 0.2
STEADY_S = 6.0
"""Batch runs this long before the move, so the replicas hold their full load."""


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Arm:
    mode: Mode
    ranking_ms: list[float] = field(default_factory=list)
    ranking_errors: int = 0
    batch_answers_in_window: int = 0
    withdrawn: int = 0
    batch_errors: int = 0


async def batch_loop(
    client: LLMClient, worker: int, documents: list[str], answered: list[float], errors: list[int]
) -> None:
    n = 0
    while True:
        n += 1
        body = documents[(worker + n) % len(documents)]
        messages = [  # the call's own name first: no two share more than the system prompt's prefix
            {"role": "system", "content": "Summarise the product for a catalogue."},
            {"role": "user", "content": f"document {worker}-{n}: {body}"},
        ]
        try:
            await client.chat(messages, routing_key=f"doc-{worker}-{n}", max_tokens=BATCH_MAX_TOKENS)
            answered.append(time.monotonic())
        except LLMError:
            errors[0] += 1


async def run_arm(arm: Arm, batch_calls: int, handoff_s: float, window_s: float) -> None:
    batch_settings = BatchSettings()
    async with SimulatorFleet(2) as fleet:
        r0, r1 = fleet.urls
        batch_replicas = [r1] if arm.mode == "idle" else [r0, r1]
        async with (
            LLMClient(batch_client_config(batch_replicas, MODEL, batch_settings)) as batch,
            LLMClient(realtime_client_config([r0], MODEL)) as real_time,
        ):
            answered: list[float] = []
            errors = [0]
            rng = random.Random(3)
            documents = [
                document(rng, BATCH_DOCUMENT_WORDS) for _ in range(64)
            ]  # made once: CPU for the replicas
            workers = [
                asyncio.create_task(batch_loop(batch, w, documents, answered, errors))
                for w in range(2 * batch_calls)
            ]
            try:
                await asyncio.sleep(STEADY_S)
                batch.set_endpoints([r1], withdraw_after_s=withdrawal(arm.mode, handoff_s))
                await asyncio.sleep(handoff_s)
                joined = time.monotonic()
                rng = random.Random(7)
                rankings: list[asyncio.Task[None]] = []
                while time.monotonic() - joined < window_s:
                    rankings.append(asyncio.create_task(ranking(real_time, rng, len(rankings), arm)))
                    await asyncio.sleep(RANKING_EVERY_S)
                await asyncio.gather(*rankings)
                arm.batch_answers_in_window = sum(1 for t in answered if joined <= t < joined + window_s)
                arm.withdrawn = batch.withdrawn
                arm.batch_errors = errors[0]
            finally:
                for task in workers:
                    task.cancel()
                for task in workers:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task


def withdrawal(mode: Mode, handoff_s: float) -> float | None:
    """When batch cuts its calls on the replica it lost, as ``capacity.pool.PoolFollower`` does."""
    if mode == "withdraw":
        return max(0.0, handoff_s - ABORT_NOTICE_S)
    return handoff_s if mode == "at_join" else None


async def ranking(client: LLMClient, rng: random.Random, n: int, arm: Arm) -> None:
    messages = [
        {"role": "system", "content": "Rank the candidates for the shopper."},
        {"role": "user", "content": f"shopper {n}: {document(rng, RANKING_WORDS)}"},
    ]
    started = time.perf_counter()
    try:
        await client.chat(messages, routing_key=f"shopper-{n}", max_tokens=RANKING_MAX_TOKENS, deadline_s=30)
        arm.ranking_ms.append((time.perf_counter() - started) * 1000)
    except LLMError:
        arm.ranking_errors += 1


def batch_prompt_tokens() -> int:
    """A batch call's document, as the simulator counts its tokens."""
    return count_tokens(document(random.Random(0), BATCH_DOCUMENT_WORDS))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-calls", type=int, default=128, help="batch calls in flight per replica")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--handoff-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    arms: dict[Mode, list[Arm]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
            arm = Arm(mode)
            asyncio.run(run_arm(arm, args.batch_calls, args.handoff_s, args.window_s))
            arms[mode].append(arm)
            print(
                f"repeat {repeat + 1} {mode}: ranking p50 {percentile(arm.ranking_ms, 0.5):.0f} ms, "
                f"withdrawn {arm.withdrawn}",
                flush=True,
            )

    headers = [
        "batch's calls on the handed-over replica",
        "real-time p50 ms",
        "real-time p99 ms",
        "real-time max ms",
        "batch answers in the window",
        "batch calls withdrawn",
        "prompt tokens paid again",
        "real-time calls failed",
        "batch calls failed",
    ]
    rows: list[list[object]] = []
    for name, runs in arms.items():
        p50 = [percentile(a.ranking_ms, 0.5) for a in runs]
        p99 = [percentile(a.ranking_ms, 0.99) for a in runs]
        rows.append(
            [
                ARM_NAMES[name],
                spread(p50),
                spread(p99),
                f"{max(max(a.ranking_ms, default=float('nan')) for a in runs):.0f}",
                spread([float(a.batch_answers_in_window) for a in runs]),
                spread([float(a.withdrawn) for a in runs]),
                spread([a.withdrawn * batch_prompt_tokens() for a in runs]),
                failed_of(runs),
                str(sum(a.batch_errors for a in runs)),
            ]
        )
    print(machine())
    table = print_table(headers, rows)
    print(load_average())
    write_results(
        "handoff.json",
        {
            "args": vars(args),
            "load_average_start": load_before,
            "runs": {
                name: [
                    {
                        "ranking_ms": a.ranking_ms,
                        "ranking_errors": a.ranking_errors,
                        "batch_answers_in_window": a.batch_answers_in_window,
                        "withdrawn": a.withdrawn,
                        "batch_errors": a.batch_errors,
                    }
                    for a in runs
                ]
                for name, runs in arms.items()
            },
            "table": table,
        },
    )


def failed_of(runs: list[Arm]) -> str:
    failed = sum(a.ranking_errors for a in runs)
    return f"{failed} of {failed + sum(len(a.ranking_ms) for a in runs)}"


def spread(values: list[float]) -> str:
    """Median [min, max] over the repeats (those with a value)."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} [{min(values):.0f}, {max(values):.0f}]"


if __name__ == "__main__":
    main()
