"""The stress scenarios and the setups (sim, kill, llama, scenarios) a run is made of."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from bench.routing.consts import BLOCK, RESULTS
from bench.routing.fleet import engine_options, measure_capacity, replica_kv_blocks, ttft_floor_ms
from bench.routing.plots import plot
from bench.routing.replay import run_llama, run_sim
from bench.routing.report import _write, aggregate_table, llama_table, machine, scenario_table, sim_table
from bench.routing.stats import RunResult, aggregate, recovery, scenario_targets, targets
from bench.trace import (
    OracleBound,
    TraceConfig,
    TraceRequest,
    generate_trace,
    oracle_prefill,
    with_onoff_arrivals,
    with_poisson_arrivals,
)

# ---- stress scenarios -------------------------------------------------------------------------------
SCENARIO_POLICIES = (
    "round_robin", "least_outstanding", "session_affinity", "prefix_aware", "prefix_aware_precise",
    "prefix_aware_noguard", "prefix_aware_spread",
)  # fmt: skip


RESTART_POLICIES = ("prefix_aware", "prefix_aware_precise")
"""The reset scenario compares the two ways of learning about it; the baselines learn nothing."""


@dataclass(frozen=True)
class Scenario:
    """One load shape: the trace, the arrival process, the replicas' cache size (0: the simulator's own,
    sized from the GPU's memory), an optional reset."""

    name: str
    description: str
    trace: TraceConfig
    bursty: bool = False
    cache_blocks: int = 0
    reset_at_fraction: float | None = None


def scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    """The stress shapes, every parameter from the command line."""
    base = TraceConfig(shoppers=args.shoppers, seed=args.seed)
    skew = replace(
        base,
        hot_count=args.skew_hot_shoppers,
        hot_factor=args.skew_hot_factor,
        hot_span_s=base.session_spread_s,
    )
    long = replace(
        base,
        hot_fraction=args.long_hot_fraction,
        hot_factor=args.long_hot_factor,
        max_log_tokens=args.long_max_log_tokens,
        hot_span_s=base.session_spread_s,
    )
    return {
        "base": Scenario("base", "the sweep's trace, Poisson arrivals", base),
        "skew": Scenario(
            "skew",
            f"{args.skew_hot_shoppers} hot shoppers with {args.skew_hot_factor:g}x the bursts, Poisson",
            skew,
        ),
        "burst": Scenario(
            "burst",
            f"skew + on/off arrivals ({args.burst_peak:g}x the mean rate for {args.burst_on_fraction:.0%} of "
            f"every {args.burst_period_s:g} s)",
            skew,
            bursty=True,
        ),
        "long": Scenario(
            "long",
            f"{args.long_hot_fraction:.0%} long-session shoppers ({args.long_hot_factor:g}x the bursts), "
            f"logs trimmed at {args.long_max_log_tokens} tokens",
            long,
        ),
        "evict": Scenario(
            "evict",
            f"skew with {args.evict_cache_blocks} KV blocks per replica (eviction pressure)",
            skew,
            cache_blocks=args.evict_cache_blocks,
        ),
        "restart": Scenario(
            "restart",
            f"base, replica {args.kill_replica}'s cache emptied at half the prompts",
            base,
            reset_at_fraction=0.5,
        ),
    }


async def run_scenarios(args: argparse.Namespace) -> list[RunResult]:
    chosen = [scenarios(args)[name] for name in args.scenarios.split(",")]
    policies = [p for p in args.scenario_policies.split(",") if p]
    results: list[RunResult] = []
    traces: dict[TraceConfig, tuple[list[TraceRequest], OracleBound, float]] = {}
    for sc in chosen:
        if sc.trace not in traces:
            trace = generate_trace(sc.trace)
            traces[sc.trace] = (
                trace,
                oracle_prefill(trace, BLOCK),
                await measure_capacity(trace, engine_options=engine_options(args)) * args.replicas,
            )
        trace, oracle, capacity = traces[sc.trace]
        rate = args.scenario_utilisation * capacity
        blocks = sc.cache_blocks or replica_kv_blocks(args)
        top = Counter(r.shopper_id for r in trace).most_common(args.skew_hot_shoppers)
        print(
            f"\n## {sc.name}: {sc.description}\n{len(trace)} prompts from {sc.trace.shoppers} shoppers "
            f"(busiest {len(top)}: {sum(n for _, n in top) / len(trace):.0%} of the prompts), "
            f"{oracle.prompt_tokens:,} prompt tokens, oracle prefill {oracle.prefill_tokens_per_shopper:,}; "
            f"{args.scenario_utilisation:.0%} of {capacity:.2f} req/s; {blocks} KV blocks/replica",
            flush=True,
        )
        fleet_args = ["--cache-capacity-blocks", str(blocks), "--kv-event-buffer-max-size", "65536"]
        # The router's index is bounded by what a replica holds, as an operator would set it.
        options = {"max_blocks_per_replica": blocks, **json.loads(args.prefix_aware_options)}
        for repeat in range(args.repeats):
            # Each repeat draws new arrival times for the same prompts; every policy gets the same ones.
            arrival_seed = args.seed + repeat
            if sc.bursty:
                timed = with_onoff_arrivals(
                    trace,
                    rate,
                    peak_factor=args.burst_peak,
                    on_fraction=args.burst_on_fraction,
                    period_s=args.burst_period_s,
                    seed=arrival_seed,
                )
            else:
                timed = with_poisson_arrivals(trace, rate, seed=arrival_seed)
            for policy in [p for p in policies if sc.reset_at_fraction is None or p in RESTART_POLICIES]:
                result, _ = await run_sim(
                    policy,
                    args.scenario_utilisation,
                    trace,
                    capacity,
                    oracle,
                    args,
                    timed=timed,
                    fleet_args=fleet_args,
                    options=options,
                    reset_at_fraction=sc.reset_at_fraction,
                    setup=sc.name,
                )
                result.policy = policy
                result.extra["repeat"], result.extra["arrival_seed"] = repeat, arrival_seed
                results.append(result)
                print(
                    scenario_table([result]).splitlines()[-1],
                    f"(repeat {repeat}, {result.wall_s:.0f} s wall, load {result.extra['loadavg_1m']})",
                    flush=True,
                )
                print(
                    "   tail:",
                    json.dumps(result.extra.get("tail")),
                    json.dumps(result.extra.get("policy_stats")),
                )
                server_tail = result.extra.get("server_tail") or {}
                print("   server tail:", json.dumps({k: server_tail.get(k) for k in ("p99_set", "all")}))
        for line in scenario_targets(aggregate([r for r in results if r.setup == sc.name])):
            print("  ", line)
    return results


def report_scenarios(results: Sequence[RunResult], args: argparse.Namespace) -> None:
    """Print the per-run and pooled tables and the targets; write ``routing_scenarios<TAG>.json``."""
    print("\n" + scenario_table(results))
    aggregates = aggregate(results)
    print("\n" + aggregate_table(aggregates))
    verdicts: dict[str, list[str]] = {}
    for name in dict.fromkeys(r.setup for r in results):
        verdicts[name] = scenario_targets([a for a in aggregates if a.setup == name])
        for line in verdicts[name]:
            print("  ", line)
    _write(
        f"routing_scenarios{args.tag}.json",
        {
            "machine": machine(),
            "args": vars(args),
            "results": [asdict(r) for r in results],
            "aggregates": [
                {k: v for k, v in asdict(a).items() if k not in ("ttfts", "results")} for a in aggregates
            ],
            "targets": verdicts,
        },
    )


async def _other_setups(args: argparse.Namespace, setups: set[str], policies: list[str]) -> None:
    sim_results: list[RunResult] = []
    kill_result: RunResult | None = None
    if setups & {"sim", "kill"}:
        trace = generate_trace(TraceConfig(shoppers=args.shoppers, seed=args.seed))
        oracle = oracle_prefill(trace, BLOCK)
        capacity = await measure_capacity(trace, engine_options=engine_options(args)) * args.replicas
        mean_tokens = oracle.prompt_tokens / len(trace)
        print(
            f"trace: {len(trace)} prompts from {args.shoppers} shoppers, {oracle.prompt_tokens:,} prompt "
            f"tokens (mean {mean_tokens:,.0f}); oracle prefill {oracle.prefill_tokens_per_shopper:,} "
            f"(global bound {oracle.prefill_tokens_global:,}); cache-oblivious capacity {capacity:.2f} "
            f"req/s for {args.replicas} replicas; time scale {args.time_scale}"
        )
        options = {"max_blocks_per_replica": replica_kv_blocks(args), **json.loads(args.prefix_aware_options)}
        if "sim" in setups:
            for utilisation in (float(u) for u in args.utilisations.split(",")):
                for policy in policies:
                    result, _ = await run_sim(
                        policy, utilisation, trace, capacity, oracle, args, options=options
                    )
                    sim_results.append(result)
                    print(sim_table([result]).splitlines()[-1], f"({result.wall_s:.0f} s wall)", flush=True)
            print("\n" + sim_table(sim_results))
            for u in sorted({r.utilisation for r in sim_results}):
                rs = [r for r in sim_results if r.utilisation == u]
                # Little's law: requests running per replica = throughput per replica x e2e latency.
                batch = max(
                    1,
                    round(
                        statistics.fmean(r.throughput_rps * r.e2e_mean_ms / 1000 for r in rs) / args.replicas
                    ),
                )
                floor_oracle, floor_head = ttft_floor_ms(trace, batch, engine_options(args))
                for r in rs:
                    r.extra["ttft_floor_oracle_ms"], r.extra["ttft_floor_head_only_ms"] = (
                        floor_oracle,
                        floor_head,
                    )
                print(
                    f"  {u:.0%}: TTFT floor (no queueing, batch {batch}): {floor_oracle:.0f} ms with oracle "
                    f"caching, {floor_head:.0f} ms with head-only caching "
                    f"(ratio {floor_oracle / floor_head:.2f})"
                )
                for line in targets(sim_results, u):
                    print(f"  {u:.0%}: {line}")
            _write(
                f"routing{args.tag}.json",
                {
                    "machine": machine(),
                    "args": vars(args),
                    "capacity_rps": capacity,
                    "oracle": asdict(oracle),
                    "results": [asdict(r) for r in sim_results],
                },
            )
        if "kill" in setups:
            reference = next(
                (
                    r
                    for r in sim_results
                    if r.policy == "prefix_aware" and r.utilisation == args.kill_utilisation
                ),
                None,
            )
            if reference is None:  # the same run without a kill, to compare with window by window
                reference, _ = await run_sim(
                    "prefix_aware", args.kill_utilisation, trace, capacity, oracle, args, options=options
                )
            kill_result, _ = await run_sim(
                "prefix_aware",
                args.kill_utilisation,
                trace,
                capacity,
                oracle,
                args,
                kill_at_fraction=0.5,
                options=options,
            )
            kill_result.extra.update(recovery(kill_result, reference))
            print("\nno kill (reference):\n" + sim_table([reference]))
            extra = {k: v for k, v in kill_result.extra.items() if "windows" not in k}
            print("\nkill run (prefix_aware, one replica SIGKILLed halfway):")
            print(sim_table([kill_result]))
            print(json.dumps(extra, indent=1, default=str))
            _write(
                f"routing{args.tag}_kill.json",
                {
                    "machine": machine(),
                    "args": vars(args),
                    "result": asdict(kill_result),
                    "reference": asdict(reference),
                },
            )
        plot(sim_results, kill_result, RESULTS, args.tag)
    if "llama" in setups:
        llama_trace = generate_trace(
            TraceConfig(
                shoppers=args.llama_shoppers,
                hot_fraction=0.0,
                bursts=(2, 3),
                burst_events=(2, 4),
                backlog_events=(4, 7),
                max_log_tokens=700,
                max_tokens=(8, 12),
                seed=args.seed,
            )
        )
        oracle = oracle_prefill(llama_trace, BLOCK)
        print(
            f"\nllama: {len(llama_trace)} prompts from {args.llama_shoppers} shoppers, mean "
            f"{oracle.prompt_tokens / len(llama_trace):,.0f} tokens (project tokenizer); oracle cached share "
            f"{1 - oracle.prefill_tokens_per_shopper / oracle.prompt_tokens:.0%}"
        )
        llama_results = []
        for policy in policies:
            result = await run_llama(policy, llama_trace, oracle, args)
            llama_results.append(result)
            print(llama_table([result]).splitlines()[-1], flush=True)
        print("\n" + llama_table(llama_results))
        _write(
            f"routing{args.tag}_llama.json",
            {"machine": machine(), "args": vars(args), "results": [asdict(r) for r in llama_results]},
        )
