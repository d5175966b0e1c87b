"""How much longer prompts get now that the stand-in tokenizer splits every digit, as Qwen2's does.

The stand-in tokenizer (``prompt_assembly.tokens``) used to take up to three digits a token (" 2025" was
" 202" and "5"); Qwen2's pre-tokenizer takes one digit a token and the space before a number on its own.
This assembles the synthetic stream's prompts twice, once budgeted with each split, and counts every
prompt's text with both: the ratio says how far the old count undershot, the lines say what the
activity-log budget now keeps. Pure CPU, one process.

    python -m bench.tokenizer_digits [--events 50000] [--shoppers 500]
"""

from __future__ import annotations

import argparse
import re
import statistics

import prompt_assembly.tokens as tokens
from bench.common import machine, percentile, print_table, stream_prompts, write_results
from devstack.synthetic import SyntheticStream
from prompt_assembly.records import PromptRequest
from prompt_assembly.tokens import messages_text

THREE_DIGITS = re.compile(r" ?[A-Za-z]{1,8}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s+")
"""The stand-in tokenizer's split before digits were split one by one."""
ONE_DIGIT = tokens._PIECE


def assemble(events: int, shoppers: int, split: re.Pattern[str]) -> list[PromptRequest]:
    """The stream's prompts, with ``split`` as the tokenizer the prompt budget counts with."""
    saved, tokens._PIECE = tokens._PIECE, split
    try:
        records = [value for _, value, _ in SyntheticStream(shoppers=shoppers, seed=7).take(events)]
        return stream_prompts(records)
    finally:
        tokens._PIECE = saved


def measure(prompts: list[PromptRequest]) -> dict[str, float]:
    texts = [messages_text(p.messages) for p in prompts]
    old = [len(THREE_DIGITS.findall(t)) for t in texts]
    new = [len(ONE_DIGIT.findall(t)) for t in texts]
    lines = [messages_text(p.messages[-1:]).count("\n") for p in prompts]
    return {
        "prompts": len(prompts),
        "tokens_three_digit_p50": percentile(old, 0.5),
        "tokens_one_digit_p50": percentile(new, 0.5),
        "tokens_one_digit_p90": percentile(new, 0.9),
        "tokens_one_digit_mean": statistics.mean(new),
        "ratio_mean": statistics.mean(n / o for n, o in zip(new, old, strict=True)),
        "log_lines_mean": statistics.mean(lines),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--shoppers", type=int, default=500)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    results = []
    rows = []
    splits = (("three digits a token (before)", THREE_DIGITS), ("one digit a token (now)", ONE_DIGIT))
    for name, split in splits:
        r = {"budgeted_with": name, **measure(assemble(args.events, args.shoppers, split))}
        results.append(r)
        rows.append(
            [
                name,
                r["prompts"],
                f"{r['tokens_three_digit_p50']:.0f}",
                f"{r['tokens_one_digit_p50']:.0f} / {r['tokens_one_digit_p90']:.0f}",
                f"{r['ratio_mean']:.3f}",
                f"{r['log_lines_mean']:.1f}",
            ]
        )
    table = print_table(
        [
            "prompt budget counts",
            "prompts",
            "tokens p50, three-digit count",
            "tokens p50 / p90, one-digit count",
            "one-digit / three-digit, mean",
            "lines in the last message, mean",
        ],
        rows,
    )
    write_results(
        "tokenizer_digits.json",
        {"events": args.events, "shoppers": args.shoppers, "results": results, "table": table},
    )


if __name__ == "__main__":
    main()
