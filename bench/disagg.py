"""Goodput of prefill/decode disaggregation against aggregated serving, on eight simulated H100s.

Goodput is the highest offered rate (requests per simulated second) at which p99 time to first token
is at most X and p99 inter-token latency (each request's largest gap between two tokens) at most Y;
reported per GPU. It is found by search (``bench.goodput_search``): per SLO column and repeat (each
repeat its own Poisson arrival times), a bracket of offered rates is halved until its ends are within
``--tolerance`` (5%) of each other; the column shows the median over ``--repeats`` (3) and the interval
from the lowest passing to the highest failing rate. Each probe's p99s also come with a bootstrap interval
over its requests (95%, 400 resamples).

    python -m bench.disagg [--quick] [--cost roofline additive fused] [--workloads seed ours]

``--cost``: ``roofline`` (default) runs the simulator's defaults, TensorRT-LLM's (one fused pass per
iteration on the H100 roofline, KV blocks sized from the card's memory, GUARANTEED_NO_EVICT);
``additive`` and ``fused`` run the eager-PyTorch calibration table (``--cost-model eager_pytorch``)
with a mixed iteration priced as prefill + decode or as the larger of the two, as before the simulator
became faithful; the KV size and the scheduler are the faithful ones in all three.

Setups (8 GPUs, one simulated replica each, qwen2.5-32b on H100):
- ``agg``: 8 aggregated replicas, ``prefix_aware`` routing; ``agg-chunked``: the same with chunked
  prefill (1,024-token iterations, which is what bounds a decode step behind a prefill);
- ``xPyD-remote`` (2P6D, 4P4D, 6P2D): x context and y generation replicas, ``pd_aware`` with every
  prefill remote (``max_local_prefill_tokens`` 0: pure P/D, TensorRT-LLM without conditional disagg);
- ``xPyD-cond``: conditional disaggregation by size alone (512 tokens, as TensorRT-LLM's
  ``conditional_disagg_config``), spilling prefills onto decode servers when the context pool is busy;
- ``xPyD-idle``: ``pd_aware``'s defaults, inter-token latency first: a local prefill of at most 512
  uncached tokens only on a decode server with nothing in flight, and no spill when the pool is busy;
- ``xPyD-trtllm-cond`` / ``xPyD-trtllm-remote``: TensorRT-LLM's own front end instead of our client's
  routing: the ``trtllm-serve disaggregated`` stand-in (``serving.disagg_router``) with the production
  YAML (``serving/trtllm/disagg/disagg_config.yaml``: ``kv_cache_aware`` routers on both pools, fed by
  the replicas' KV cache events) with or without its ``conditional_disagg_config`` (512 tokens). The
  client sends every request to the stand-in; a stand-in of its own per rate, like the client.

Workloads:
- ``seed``: the published case: cold 2-4k-token prompts (each request a prompt of its own), ~200 out;
- ``ours``: shopper prompts from ``bench.trace`` (growing per-shopper logs, heavy prefix reuse).

Times are the replicas' own (``GET /perf_metrics``, simulated ms, so host jitter at the time scale is
all that leaks in): TTFT of an aggregated or locally prefilled request is its replica's; of a remote
one, the context replica's TTFT plus the generation replica's (the pull, its first decode step); the
HTTP hops between them are left out. The client does not stream (``stream: false``): the replicas
generate every token all the same, and the client's own load stays small on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import machine, percentile, print_table, results_dir
from bench.goodput_search import (
    Goodput,
    GoodputSearch,
    SearchPlan,
    add_search_arguments,
    brackets_from_json,
    goodput_cell,
)
from bench.trace import TraceConfig, TraceRequest, generate_trace, with_poisson_arrivals
from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.errors import LLMError
from llm_client.routing.pd_aware import PdAwarePolicy
from serving.disagg_router.app import SERVICE, create_app
from serving.disagg_router.config import DisaggConfig
from serving.disagg_router.service import DisaggService
from serving.simulator.launch import REPO_ROOT, SimulatorFleet

GPUS = 8
RESULTS = results_dir() / "disagg_matrix.json"
RESULTS_QUICK = results_dir() / "disagg_matrix_quick.json"
"""Where ``--quick`` writes unless ``--out`` says otherwise: a smoke run never overwrites the matrix."""
STANDIN = "trtllm-standin"
PRODUCTION_YAML = REPO_ROOT / "serving" / "trtllm" / "disagg" / "disagg_config.yaml"
KV_EVENTS = ("--kv-event-buffer-max-size", "16384")
"""The stand-in's kv_cache_aware routers need the replicas' events (as the production YAMLs buffer)."""


@dataclass(frozen=True)
class Setup:
    name: str
    contexts: int
    policy: str
    engine: tuple[str, ...] = ()
    max_local: int | None = 0
    """``pd_aware``'s ``max_local_prefill_tokens``; the stand-in's ``max_local_prefill_length``, None
    for no ``conditional_disagg_config``."""
    knobs: tuple[tuple[str, object], ...] = ()
    """More ``PdAwareSettings`` knobs."""


def setups(quick: bool, cond_tokens: Sequence[int] = (512,)) -> list[Setup]:
    chunked = ("--enable-chunked-prefill", "true", "--max-num-tokens", "1024")
    out = [Setup("agg", 0, "prefix_aware"), Setup("agg-chunked", 0, "prefix_aware", chunked)]
    for contexts in (2,) if quick else (2, 4, 6):
        split = f"{contexts}P{GPUS - contexts}D"
        out.append(Setup(f"{split}-remote", contexts, "pd_aware", max_local=0))
        # the size rule alone (TensorRT-LLM's conditional_disagg_config), spilling when the pool is busy
        size_only = (("local_only_when_idle", False), ("local_when_busy", True))
        for tokens in cond_tokens:
            suffix = "" if tokens == 512 else str(tokens)
            out.append(
                Setup(f"{split}-cond{suffix}", contexts, "pd_aware", max_local=tokens, knobs=size_only)
            )
        # pd_aware's defaults, inter-token latency first: local only on an idle decode server, no spill
        out.append(Setup(f"{split}-idle", contexts, "pd_aware", max_local=512))
        # TensorRT-LLM's own front end (the stand-in) with the production YAML, and without its rule
        out.append(Setup(f"{split}-trtllm-cond", contexts, STANDIN, max_local=512))
        out.append(Setup(f"{split}-trtllm-remote", contexts, STANDIN, max_local=None))
    return out


WORKLOADS = ("seed", "ours")


def workload(kind: str, requests: int, seed: int) -> list[TraceRequest]:
    """``requests`` prompts in order (arrival times set later, per rate)."""
    if kind == "ours":
        trace = generate_trace(TraceConfig(shoppers=120, seed=seed))
        return trace[:requests]
    rng = random.Random(seed)
    trace = generate_trace(TraceConfig(shoppers=60, seed=seed + 1))
    cold = []
    for i in range(requests):
        base = trace[i % len(trace)]
        salt = f"Request {i}-{rng.getrandbits(64):x}. "  # first in the prompt: nothing is shared
        messages = [
            {**m, "content": salt + m["content"]} if j == 0 else m for j, m in enumerate(base.messages)
        ]
        cold.append(TraceRequest(f"cold-{i}", 0, 0.0, messages, base.prompt_tokens, base.max_tokens))
    return cold


@dataclass
class RatePoint:
    rate: float
    requests: int
    errors: int
    remote_share: float
    ttft_p99: float
    ttft_ci: tuple[float, float]
    itl_p99: float
    itl_ci: tuple[float, float]
    ttft_p50: float
    itl_p50: float
    repeat: int = 0


@dataclass
class SetupResult:
    workload: str
    cost: str
    setup: str
    gpus_context: int
    points: list[RatePoint] = field(default_factory=list)
    searched: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per SLO column (``slo_name``): every repeat's bracket (``bench.goodput_search.Bracket``)."""


def bootstrap_p99(values: Sequence[float], rng: random.Random, rounds: int = 400) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    estimates = sorted(percentile([rng.choice(values) for _ in values], 0.99) for _ in range(rounds))
    return estimates[int(0.025 * rounds)], estimates[int(0.975 * rounds) - 1]


async def drain_perf(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for url in urls:
        async with session.get(f"{url}/perf_metrics") as response:
            records += await response.json()
    return records


def server_times(records: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(TTFT, largest inter-token gap) per request, simulated ms, joined across roles."""
    contexts = {r["ctx_request_id"]: r for r in records if r["request_type"] == "context_only"}
    ttft, itl = [], []
    for r in records:
        sim = r["simulator"]
        if r["request_type"] == "context_only":
            continue
        first = sim["ttft_ms"]
        if r["request_type"] == "generation_only":
            context = contexts.get(r["ctx_request_id"])
            if context is None:
                continue
            first += context["simulator"]["ttft_ms"]
        ttft.append(first)
        itl.append(sim["max_itl_ms"])
    return ttft, itl


async def run_rate(
    client: LLMClient,
    trace: Sequence[TraceRequest],
    rate: float,
    time_scale: float,
    urls: Sequence[str],
    session: aiohttp.ClientSession,
    rng: random.Random,
    standin: DisaggService | None = None,
    repeat: int = 0,
) -> RatePoint:
    timed = with_poisson_arrivals(trace, rate, seed=int(rate * 1000) + 7919 * repeat)
    policy = client.policy
    before = asdict(policy.stats) if isinstance(policy, PdAwarePolicy) else None
    errors = 0

    async def one(request: TraceRequest) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, start + request.t * time_scale - time.perf_counter()))
        try:
            await client.chat(
                request.messages,
                routing_key=request.shopper_id,
                max_tokens=request.max_tokens,
                prompt_tokens=request.prompt_tokens,
            )
        except LLMError:
            errors += 1

    await drain_perf(session, urls)  # what an earlier rate left
    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in timed))
    ttft, itl = server_times(await drain_perf(session, urls))
    remote = 0.0
    if isinstance(policy, PdAwarePolicy) and before is not None:
        after = asdict(policy.stats)
        delta = {k: after[k] - before[k] for k in after}
        local = delta["local_small"] + delta["local_share"] + delta["local_busy"] + delta["local_no_context"]
        remote = delta["remote"] / max(1, delta["remote"] + local)
    if standin is not None:  # a stand-in of this rate's own
        counted = standin.counters
        remote = counted.context_requests / max(1, counted.context_requests + counted.local_prefills)
    return RatePoint(
        rate=rate,
        requests=len(ttft),
        errors=errors,
        remote_share=remote,
        ttft_p99=percentile(ttft, 0.99),
        ttft_ci=bootstrap_p99(ttft, rng),
        itl_p99=percentile(itl, 0.99),
        itl_ci=bootstrap_p99(itl, rng),
        ttft_p50=percentile(ttft, 0.5),
        itl_p50=percentile(itl, 0.5),
        repeat=repeat,
    )


@asynccontextmanager
async def serving_standin(
    setup: Setup, contexts: Sequence[str], generations: Sequence[str]
) -> AsyncIterator[tuple[str, DisaggService]]:
    """The production YAML's front end over these replicas, in this process, on a free port."""
    conditional = None if setup.max_local is None else {"max_local_prefill_length": setup.max_local}
    config = DisaggConfig.load(PRODUCTION_YAML).with_overrides(
        context_urls=list(contexts), generation_urls=list(generations), conditional_disagg_config=conditional
    )
    app = create_app(config, request_timeout_s=600)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield f"http://127.0.0.1:{port}", app[SERVICE]
    finally:
        await runner.cleanup()


COSTS = {
    "roofline": (),
    "additive": ("--cost-model", "eager_pytorch", "--mixed-batch-cost", "additive"),
    "fused": ("--cost-model", "eager_pytorch", "--mixed-batch-cost", "fused"),
}
"""``--cost``: the simulator flags of each iteration cost (``roofline``: the simulator's default)."""


def slo_name(ttft_slo: float, itl_slo: float) -> str:
    return f"ttft{ttft_slo:g}_itl{itl_slo:g}"


def meets_slo(ttft_slo: float, itl_slo: float) -> Callable[[RatePoint], bool]:
    """Whether a probe meets a column: both p99s (point estimates) within it and no request lost."""
    return lambda p: p.ttft_p99 <= ttft_slo and p.itl_p99 <= itl_slo and not p.errors


async def run_setup(
    setup: Setup, kind: str, cost: str, plan: SearchPlan | Sequence[float], args: argparse.Namespace
) -> SetupResult:
    """One setup on one fleet: every probe starts cold (caches reset, a client of its own). ``plan``: a
    goodput search over the SLO columns, or a plain ladder of rates (``--rates``)."""
    common: tuple[str, ...] = ("--time-scale", str(args.time_scale), *COSTS[cost])
    common += ("--stream-coalesce-s", "0.05", *(KV_EVENTS if setup.policy == STANDIN else ()))
    result = SetupResult(kind, cost, setup.name, setup.contexts)
    trace = workload(kind, args.requests, seed=11)
    rng = random.Random(5)
    async with (
        SimulatorFleet(
            GPUS - setup.contexts,
            *common,
            *setup.engine,
            *(("--role", "generation") if setup.contexts else ()),
        ) as decoders,
        SimulatorFleet(setup.contexts, *common, "--role", "context") as contexts,
        aiohttp.ClientSession() as session,
    ):
        urls = [*decoders.urls, *contexts.urls]

        async def measure(rate: float, repeat: int) -> RatePoint:
            for url in urls:  # every probe starts cold: empty caches, no events left from the last
                async with session.post(f"{url}/admin/reset_cache") as response:
                    response.raise_for_status()
                if setup.policy == STANDIN:
                    async with session.post(f"{url}/kv_cache_events") as response:
                        response.raise_for_status()
            if setup.policy == STANDIN:  # a stand-in of this probe's own, the client sending it all
                async with serving_standin(setup, contexts.urls, decoders.urls) as (front, standin):
                    config = client_config(setup, [front], [], standin=True)
                    async with LLMClient(config) as client:
                        point = await run_rate(
                            client, trace, rate, args.time_scale, urls, session, rng, standin, repeat
                        )
            else:
                async with LLMClient(client_config(setup, decoders.urls, contexts.urls)) as client:
                    point = await run_rate(
                        client, trace, rate, args.time_scale, urls, session, rng, repeat=repeat
                    )
            result.points.append(point)
            print(
                f"  {kind:5} {cost:8} {setup.name:18} {rate:6.2f}/s r{repeat}  "
                f"TTFT p99 {point.ttft_p99:7.0f} ms  ITL p99 {point.itl_p99:6.0f} ms  "
                f"remote {point.remote_share:4.0%}  errors {point.errors}",
                flush=True,
            )
            return point

        if isinstance(plan, SearchPlan):
            meets = {slo_name(t, i): meets_slo(t, i) for t, i in SLOS}
            found = await GoodputSearch(measure, meets, plan).run()
            result.searched = {name: [asdict(b) for b in g.brackets] for name, g in found.items()}
        else:
            for rate in plan:
                await measure(rate, 0)
    return result


def client_config(
    setup: Setup, endpoints: Sequence[str], context_endpoints: Sequence[str], standin: bool = False
) -> ClientConfig:
    """Our client's routing for ``setup``, or (``standin``) plain forwarding to the stand-in."""
    settings: dict[str, Any] = {"policy": setup.policy}
    if setup.policy == "pd_aware":
        settings["max_local_prefill_tokens"] = setup.max_local
        if setup.max_local == 0:  # pure P/D: every prefill remote, however busy the context pool
            settings["context_busy_tokens"] = 1e12
        settings.update(dict(setup.knobs))
    return ClientConfig(
        endpoints=list(endpoints),
        context_endpoints=list(context_endpoints),
        model="qwen2.5-32b-sim",
        policy="round_robin" if standin else setup.policy,
        policy_settings=None if standin else settings,
        stream=False,
        max_in_flight=4096,
        timeouts=Timeouts(connect_s=5, attempt_s=600, deadline_s=1200),
        health=HealthSettings(interval_s=1.0),
        retry=RetrySettings(max_attempts=1),
    )


def goodput(result: SetupResult, ttft_slo: float, itl_slo: float) -> RatePoint | None:
    """A ladder's goodput (``--rates``, and results from before the search): the highest rate of the
    ladder meeting both SLOs (point estimates of p99), if any."""
    passing = [p for p in result.points if meets_slo(ttft_slo, itl_slo)(p)]
    return max(passing, key=lambda p: p.rate) if passing else None


def searched_goodput(result: SetupResult, ttft_slo: float, itl_slo: float) -> Goodput | None:
    """The searched goodput of one SLO column (None for a ladder's results)."""
    rows = result.searched.get(slo_name(ttft_slo, itl_slo))
    return None if rows is None else brackets_from_json(rows)


def goodput_text(result: SetupResult, ttft_slo: float, itl_slo: float) -> str:
    """One column's cell: searched goodput per GPU ``median [interval]``, or the ladder's rung with the
    p99 TTFT interval at that rung."""
    found = searched_goodput(result, ttft_slo, itl_slo)
    if found is not None:
        return goodput_cell(found, GPUS)
    best = goodput(result, ttft_slo, itl_slo)
    return "0" if best is None else f"{best.rate / GPUS:.2f} ({best.ttft_ci[0]:,.0f}-{best.ttft_ci[1]:,.0f})"


def report(results: Sequence[SetupResult], slos: Sequence[tuple[float, float]]) -> None:
    print(machine())
    rows = [[r.workload, r.cost, r.setup, *(goodput_text(r, t, i) for t, i in slos)] for r in results]
    headers = ["workload", "cost", "setup"] + [f"TTFT≤{t / 1000:g}s ITL≤{i:g}ms" for t, i in slos]
    print_table(headers, rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2P6D only, one repeat to 25%%; writes disagg_matrix_quick.json unless --out is given",
    )
    parser.add_argument("--cost", nargs="+", default=["roofline"], choices=sorted(COSTS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--setups", nargs="*", help="only these setup names (exact, e.g. agg-chunked 2P6D-remote)"
    )
    parser.add_argument(
        "--cond-tokens",
        type=int,
        nargs="+",
        default=[512],
        help="max_local_prefill_tokens of the -cond setups",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the results JSON goes (default bench/results/disagg_matrix.json, "
        "disagg_matrix_quick.json with --quick)",
    )
    parser.add_argument("--requests", type=int, default=160, help="requests per probe")
    parser.add_argument("--time-scale", type=float, default=0.1)
    add_search_arguments(
        parser,
        bracket_help="first bracket of the search, simulated requests/s for the whole fleet (default per "
        "workload)",
        repeats_help="searches per column, each its own arrivals",
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", help="a plain ladder of these rates instead of the search"
    )
    args = parser.parse_args(argv)
    if args.setups:
        known = [s.name for s in setups(args.quick, args.cond_tokens)]
        unknown = [name for name in args.setups if name not in known]
        if unknown:
            parser.error(
                f"--setups: no setup named {', '.join(unknown)}; choose from "
                f"{', '.join(known)}{' (with --quick)' if args.quick else ''}"
            )
    if args.out is None:
        args.out = RESULTS_QUICK if args.quick else RESULTS
    return args


SEARCH = {"seed": (4.0, 8.0), "ours": (8.0, 24.0)}
"""First bracket per workload (whole fleet, requests/s); widened by halving or doubling as needed."""
SLOS = [(1000.0, 150.0), (1000.0, 300.0), (2000.0, 150.0), (2000.0, 300.0)]


def plan(kind: str, args: argparse.Namespace) -> SearchPlan | list[float]:
    if args.rates:
        return list(args.rates)
    low, high = args.search or SEARCH[kind]
    repeats, tolerance = (1, 0.25) if args.quick else (args.repeats, args.tolerance)
    return SearchPlan(low, high, floor=low / 8, ceiling=high * 4, tolerance=tolerance, repeats=repeats)


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    chosen = [s for s in setups(args.quick, args.cond_tokens) if not args.setups or s.name in args.setups]
    results = []
    for kind in args.workloads:
        for cost in args.cost:
            for setup in chosen:
                results.append(await run_setup(setup, kind, cost, plan(kind, args), args))
                args.out.parent.mkdir(parents=True, exist_ok=True)  # what is done so far survives a stop
                payload = {"machine": machine(), "args": vars(args), "results": [asdict(r) for r in results]}
                args.out.write_text(json.dumps(payload, indent=1, default=str))
    report(results, SLOS)


if __name__ == "__main__":
    asyncio.run(main())
