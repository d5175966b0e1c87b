"""What the security measures cost on the hot paths, as ratios measured in the same run.

1. Prompt rendering: ``render_event`` with containment (``inline_text`` on titles, snippets, queries,
   brands, categories) against the previous renderer (exact-tag replace on data blocks only, brands
   and categories raw), on the synthetic stream's events: the runner renders one line per event.
2. The real-time guard's per-request work: API-key check (constant-time against N keys) and a token
   bucket take, against the cost of validating one ``MatchRequest`` (work every request does anyway).

Pure CPU, one process, no I/O. Prints the tables and the machine, and writes them to
``bench/results/security.json`` (``docs/benchmarks.md`` renders them from there). The renderer
comparison is interleaved, one pass of each per repeat: the ratio is given per repeat (median and
range), so "no measurable cost" is a statement about the spread, not one pair of numbers.

    python -m bench.security [--events 20000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import orjson
from pydantic import SecretStr

from bench.common import load_average, machine, print_table, write_results
from devstack.synthetic import SyntheticStream
from prompt_assembly import prompt as prompt_module
from prompt_assembly.events import ShopperEvent, parse_event
from realtime.auth import ApiKeyAuthenticator
from realtime.models import MatchRequest
from realtime.rate_limit import ClientRateLimiter


def _previous_render(event: ShopperEvent) -> str:
    """The renderer before containment (kept here only as the baseline)."""

    def data(text: str) -> str:
        cleaned = text.replace("<data>", "(data)").replace("</data>", "(/data)").replace("\n", " ")
        return f"<data>{cleaned}</data>"

    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(event.ts))
    if event.type == "search":
        return f"- {stamp} searched {data(event.query)}\n"
    product = event.product
    assert product is not None
    qty = f" x{event.quantity}" if event.quantity > 1 else ""
    brand = f" by {product.brand}" if product.brand else ""
    line = (
        f"- {stamp} {prompt_module._VERB[event.type]}{qty}: {data(product.title)}{brand}, "
        f"{product.category or 'uncategorised'}, ${product.price:.2f}\n"
    )
    if product.snippet:
        line += f"  about it: {data(product.snippet)}\n"
    return line


def _check_keys(auth: ApiKeyAuthenticator, key: str, calls: int) -> None:
    for _ in range(calls):
        auth.client_id(key)


def _best_ns(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best of ``repeat`` runs, nanoseconds per call (best-of filters other processes' noise)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - started) / n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    print(f"machine: {machine()}")

    events = [
        parse_event(value)
        for _, value, malformed in SyntheticStream(shoppers=200, seed=5).take(args.events)
        if not malformed
    ]
    n = len(events)
    load_before = list(os.getloadavg())
    befores, afters = [], []
    for _ in range(args.repeat):  # interleaved, so both see the same background load
        befores.append(_best_ns(lambda: [_previous_render(e) for e in events], n, 1))
        afters.append(_best_ns(lambda: [prompt_module.render_event(e) for e in events], n, 1))
    ratios = [a / b for a, b in zip(afters, befores, strict=True)]
    before, after = min(befores), min(afters)
    same = sum(_previous_render(e) == prompt_module.render_event(e) for e in events)
    render_caption = (
        f"render_event over {n:,} synthetic events ({args.repeat} interleaved repeats; ns/event: best of "
        "them; ratio: contained ÷ previous per repeat, median [min, max])"
    )
    print(f"\n{render_caption}")
    spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
    previous = [
        "previous (exact tags, brand/category raw)",
        f"{before:,.0f}",
        f"{1e9 / before:,.0f}",
        "1",
        "-",
    ]
    contained = ["contained (inline_text everywhere)", f"{after:,.0f}", f"{1e9 / after:,.0f}", spread]
    render_table = print_table(
        ["renderer", "ns / event", "events / s", "ratio", "lines identical"],
        [previous, [*contained, f"{same}/{n}"]],
    )

    candidates = [{"product_id": f"P-{i}", "title": f"Product {i}", "score": 0.5} for i in range(20)]
    body = orjson.dumps(
        {"shopper_id": "s-123", "query": "witch", "deadline_ms": 300, "candidates": candidates}
    )
    calls = 20_000
    validate = _best_ns(
        lambda: [MatchRequest.model_validate_json(body) for _ in range(calls)], calls, args.repeat
    )
    rows: list[list[object]] = [["MatchRequest validation (20 candidates)", f"{validate:,.0f}", "1.00"]]
    for keys in (1, 10):
        auth = ApiKeyAuthenticator([SecretStr(f"key-{i:04d}-0123456789abcdef") for i in range(keys)])
        presented = f"key-{keys - 1:04d}-0123456789abcdef"
        cost = _best_ns(functools.partial(_check_keys, auth, presented, calls), calls, args.repeat)
        rows.append([f"API-key check, {keys} key(s) configured", f"{cost:,.0f}", f"{cost / validate:.3f}"])
    limiter = ClientRateLimiter(rate_per_s=1e9, burst=10**9, max_clients=10_000)
    clients = [f"addr:10.0.{i // 256}.{i % 256}" for i in range(1000)]
    cost = _best_ns(
        lambda: [limiter.retry_after_s(clients[i % 1000]) for i in range(calls)], calls, args.repeat
    )
    rows.append(["token bucket take (1,000 clients)", f"{cost:,.0f}", f"{cost / validate:.3f}"])
    guard_caption = f"real-time guard, per request (best of {args.repeat}, {calls:,} calls)"
    print(f"\n{guard_caption}")
    guard_table = print_table(["step", "ns / request", "ratio to validation"], rows)
    print(load_average())
    write_results(
        "security.json",
        {
            "args": vars(args),
            "load_average_start": load_before,
            "render_ns": {"previous": befores, "contained": afters},
            "render_ratios": ratios,
            "table": f"{render_caption}:\n\n{render_table}\n\n{guard_caption}:\n\n{guard_table}",
        },
    )


if __name__ == "__main__":
    main()
