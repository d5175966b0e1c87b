"""Prompt assembly benchmark: events/s through the pure per-shopper step, prompts/s, and the
prefix-reuse ratio (tokens shared with the shopper's previous prompt / prompt tokens), on the synthetic
stream. Pure CPU, one process, no I/O.

    python -m bench.prompt_assembly [--events 50000] [--shoppers 500]
"""

from __future__ import annotations

import argparse
import time

from bench.common import machine, percentile, print_table, stream_prompts, write_results
from devstack.synthetic import SyntheticStream
from prompt_assembly.tokens import messages_text, token_ids


def run(events: int, shoppers: int, seed: int) -> dict[str, float]:
    records = [value for _, value, _ in SyntheticStream(shoppers=shoppers, seed=seed).take(events)]
    started = time.perf_counter()
    prompts = stream_prompts(records)
    seconds = time.perf_counter() - started
    # Exact reuse on a sample, by comparing token ids with the shopper's previous prompt.
    previous: dict[str, list[int]] = {}
    shared = total = exact_shared = exact_total = 0
    for i, prompt in enumerate(prompts):
        if prompt.seq > 1:
            shared += prompt.shared_prefix_tokens
            total += prompt.prompt_tokens
        if i % 10 == 0 or prompt.shopper_id in previous:
            ids = token_ids(messages_text(prompt.messages))
            before = previous.get(prompt.shopper_id)
            if before is not None and i % 10 == 0:
                n = 0
                for a, b in zip(before, ids, strict=False):
                    if a != b:
                        break
                    n += 1
                exact_shared += n
                exact_total += len(ids)
            previous[prompt.shopper_id] = ids
    sizes = [p.prompt_tokens for p in prompts]
    return {
        "events": events,
        "shoppers": shoppers,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "prompts": len(prompts),
        "prompts_per_s": len(prompts) / seconds,
        "reuse_ratio": shared / max(1, total),
        "reuse_ratio_exact_sample": exact_shared / max(1, exact_total),
        "prompt_tokens_p50": percentile(sizes, 0.5),
        "prompt_tokens_p90": percentile(sizes, 0.9),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--shoppers", type=int, default=500)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    results = []
    for events, shoppers in [(6000, 150), (args.events, args.shoppers)]:
        r = run(events, shoppers, seed=7)
        results.append(r)
        rows.append(
            [
                f"{events} events / {shoppers} shoppers",
                r["events_per_s"],
                r["prompts"],
                r["prompts_per_s"],
                r["reuse_ratio"],
                r["reuse_ratio_exact_sample"],
                f"{r['prompt_tokens_p50']:.0f} / {r['prompt_tokens_p90']:.0f}",
            ]
        )
    table = print_table(
        [
            "stream",
            "events/s",
            "prompts",
            "prompts/s",
            "prefix reuse",
            "reuse (exact, sample)",
            "prompt tokens p50/p90",
        ],
        rows,
    )
    write_results("prompt_assembly.json", {"results": results, "table": table})


if __name__ == "__main__":
    main()
