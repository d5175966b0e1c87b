"""The command line: ``python -m bench.routing``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.routing.consts import POLICIES
from bench.routing.plots import replot
from bench.routing.report import load_results, machine
from bench.routing.scenarios import SCENARIO_POLICIES, _other_setups, report_scenarios, run_scenarios

FULL: dict[str, object] = {"shoppers": 200, "utilisations": "0.5,0.7,0.9", "llama_shoppers": 6}
"""The trace's size where the command line gives none."""
QUICK: dict[str, object] = {"shoppers": 40, "utilisations": "0.7", "llama_shoppers": 4}
"""``--quick``'s: a small trace at one utilisation."""


# ---- main ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small trace, one utilisation: a smoke run (an explicit --shoppers, --utilisations or "
        "--llama-shoppers wins); its files get the tag _quick unless --tag is given",
    )
    p.add_argument("--setups", default="sim,kill,llama", help="comma list of sim, kill, llama, scenarios")
    s = p.add_argument_group("stress scenarios (--setups scenarios)")
    s.add_argument("--scenarios", default="base,skew,burst,long,evict,restart")
    s.add_argument("--scenario-policies", default=",".join(SCENARIO_POLICIES))
    s.add_argument("--scenario-utilisation", type=float, default=0.7)
    s.add_argument(
        "--repeats", type=int, default=1, help="replays per scenario and policy, each with new arrival times"
    )
    s.add_argument("--skew-hot-shoppers", type=int, default=1, help="shoppers making a large share")
    s.add_argument("--skew-hot-factor", type=float, default=35.0, help="their bursts, x an ordinary one")
    s.add_argument("--burst-peak", type=float, default=3.0, help="on-period rate, x the mean")
    s.add_argument("--burst-on-fraction", type=float, default=0.25)
    s.add_argument("--burst-period-s", type=float, default=40.0, help="simulated seconds")
    s.add_argument("--long-hot-fraction", type=float, default=0.1)
    s.add_argument("--long-hot-factor", type=float, default=8.0)
    s.add_argument("--long-max-log-tokens", type=int, default=2400)
    s.add_argument("--evict-cache-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma list; prefix_aware/setting=value runs prefix_aware with that setting changed, beside "
        "the others on the same trace (an ablation: prefix_aware,prefix_aware/load_factor=1.25)",
    )
    p.add_argument("--utilisations", default=None, help="default 0.5,0.7,0.9 (--quick: 0.7)")
    p.add_argument("--shoppers", type=int, default=None, help="default 200 (--quick: 40)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.5, help="wall seconds per simulated second")
    p.add_argument("--coalesce-s", type=float, default=0.25, help="simulator SSE coalescing (wall s)")
    p.add_argument("--kill-utilisation", type=float, default=0.7)
    p.add_argument("--kill-replica", type=int, default=3)
    p.add_argument("--llama-replicas", type=int, default=3)
    p.add_argument("--llama-shoppers", type=int, default=None, help="default 6 (--quick: 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix-aware-options", default="{}", help="JSON of PrefixAwareSettings")
    p.add_argument(
        "--engine-options",
        default="{}",
        help="JSON of SimulatorConfig settings for every replica of every policy, e.g. "
        '\'{"enable_chunked_prefill": true, "max_num_tokens": 2048}\' (capacity is measured with them)',
    )
    p.add_argument(
        "--tag",
        default=None,
        help="suffix of the result files (routing<TAG>.json ...); default none, _quick with --quick",
    )
    p.add_argument("--replot", action="store_true", help="only redraw the PNGs from the JSON results")
    p.add_argument(
        "--combine",
        default="",
        help="comma list of routing_scenarios*.json files: pool their runs (e.g. scenarios run in separate "
        "invocations), print the tables and targets, write routing_scenarios<TAG>.json; runs nothing",
    )
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:  # --quick's presets fill in only what the command line left out
            setattr(args, name, value)
    if args.tag is None:  # a smoke run never overwrites the full run's results
        args.tag = "_quick" if args.quick else ""
    return args


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args.tag)
        return
    setups = set(args.setups.split(","))
    policies = args.policies.split(",")
    print(f"machine: {machine()}")
    if args.combine:
        report_scenarios(load_results(args.combine.split(",")), args)
        return
    if "scenarios" in setups:
        report_scenarios(await run_scenarios(args), args)
    await _other_setups(args, setups, policies)
