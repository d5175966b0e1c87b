"""Heterogeneous replicas and regions: routing by predicted time to first token against the baselines.

``python -m bench.regions --scenario mixed``: six simulated H100 replicas, two of them 2x slower (a second
accelerator kind); Poisson arrivals of the shopper trace (growing per-shopper prompts) at several rates;
per policy the p99 time to first token (client side, bootstrap interval) and goodput: the highest rate
whose p99 TTFT meets the SLO. With ``--search LOW HIGH`` goodput is searched instead of read off the
``--rates`` ladder (``bench.goodput_search``: per repeat a bisection to ``--tolerance`` 5%, ``--repeats``
3, each repeat its own arrival times; the interval runs from the lowest passing to the highest failing
rate, and one policy beats another only where the intervals separate).

``--scenario surge``: two regions of three replicas, 40 ms apart, the client in the west; the west's
rate triples for the middle third of the run. ``predicted_ttft`` with spill-over against the same policy
with the east's weight at 0 (no spill-over), and the same prompts at the base rate all along (no surge,
a longer run) for the prefill tokens per request.

``--scenario lost``: the same two regions during a surge (spilled); at half time every replica of one
region is killed (``--lose east``: the region taking the spill; ``--lose west``: the client's own).
Every prompt must be answered or counted as an error; the table shows the answers per second around
the loss.

Client-side TTFT includes the round trip. Each run prints a table and writes bench/results/regions_*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import machine, percentile, print_table, results_dir
from bench.goodput_search import (
    Goodput,
    GoodputSearch,
    SearchPlan,
    add_search_arguments,
    goodput_cell,
    separates,
)
from bench.trace import TraceConfig, TraceRequest, generate_trace, with_poisson_arrivals
from llm_client import ClientConfig, LLMClient
from llm_client.degradation import DegradationDetector, DegradationSettings
from llm_client.errors import LLMError
from llm_client.routing import make_policy
from llm_client.routing.predicted_ttft import EndpointGroup, PredictedTtftPolicy, PredictedTtftSettings
from serving.simulator.config import SimulatorConfig
from serving.simulator.launch import SimulatorFleet
from serving.simulator.replica import iteration_cost

RESULTS = results_dir()
PRIOR_PROMPT_TOKENS = 2048
"""A typical shopper prompt, for the policy's priors below."""


def h100_ms_per_token() -> float:
    """Prefill ms per prompt token of the replicas' own cost model (the simulator's defaults: 32B on one
    H100): the policy's prior at time scale 1, which it then learns per replica."""
    return iteration_cost(SimulatorConfig()).prefill_ms(PRIOR_PROMPT_TOKENS) / PRIOR_PROMPT_TOKENS


@dataclass
class Sample:
    t: float
    ok: bool
    ttft_ms: float = 0.0
    group: str = ""
    prefill_tokens: int = 0


@dataclass
class Run:
    scenario: str
    setup: str
    rate: float
    samples: list[Sample] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0

    def ttfts(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [s.ttft_ms for s in self.samples if s.ok and start <= s.t < end]


def bootstrap_p99(values: Sequence[float], rng: random.Random, rounds: int = 400) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    draws = sorted(percentile([rng.choice(values) for _ in values], 0.99) for _ in range(rounds))
    return draws[int(0.025 * rounds)], draws[int(0.975 * rounds) - 1]


def trace(requests: int, seed: int, max_tokens: int) -> list[TraceRequest]:
    base = generate_trace(TraceConfig(shoppers=max(40, requests // 6), seed=seed))[:requests]
    return [replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in base]


def surge_arrivals(
    trace_: Sequence[TraceRequest], rate: float, factor: float, seconds: float
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate``, ``factor`` x that in the middle third of ``seconds``."""
    rng = random.Random(int(rate * 1000))
    t, timed = 0.0, []
    for request in trace_:
        now_rate = rate * factor if seconds / 3 <= t < 2 * seconds / 3 else rate
        t += rng.expovariate(now_rate)
        if t >= seconds:
            break
        timed.append(replace(request, t=t))
    return timed


def client_config(urls: Sequence[str]) -> ClientConfig:
    return ClientConfig.model_validate(
        {
            "endpoints": list(urls),
            "max_in_flight": 512,
            "timeouts": {"connect_s": 1, "attempt_s": 30, "deadline_s": 60},
            "retry": {"max_attempts": 3, "backoff_base_s": 0.01, "budget_min_tokens": 50},
            "health": {"interval_s": 0.5},
        }
    )


async def replay(
    run: Run, client: LLMClient, timed: Sequence[TraceRequest], group_of: dict[str, str]
) -> None:
    start = time.perf_counter()

    async def one(request: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, start + request.t - time.perf_counter()))
        try:
            answer = await client.chat(
                request.messages,
                routing_key=request.shopper_id,
                max_tokens=request.max_tokens,
                prompt_tokens=request.prompt_tokens,
            )
        except LLMError:
            run.samples.append(Sample(request.t, ok=False))
            return
        run.samples.append(
            Sample(
                request.t,
                ok=True,
                ttft_ms=answer.ttft_ms,
                group=group_of.get(answer.endpoint, "?"),
                prefill_tokens=answer.prompt_tokens - answer.cached_tokens,
            )
        )

    await asyncio.gather(*(one(r) for r in timed))
    run.stats = policy_stats(client)


def policy_stats(client: LLMClient) -> dict[str, Any]:
    """The policy's counters (and its block index's, for ``predicted_ttft``), what it learned of each
    replica's speed, and the degradation detector's drains: why a run went as it did."""
    policy = client.policy
    found: dict[str, Any] = {}
    for owner in (getattr(policy, "prefix", None), policy):
        stats = getattr(owner, "stats", None)
        if stats is not None and hasattr(stats, "__dataclass_fields__"):
            found.update(asdict(stats))
    if isinstance(policy, PredictedTtftPolicy):
        found["slowness"] = {e.name: round(policy.slowness(e), 2) for e in client.endpoints}
    found["drains"] = [f"{c.endpoint} {c.action}: {c.reason}" for c in client.degradation.changes]
    return found


def first_token_floor_ms() -> float:
    """The policy's floor: one engine iteration of the replicas' own cost model, a full decode batch of
    typical prompts (simulated ms at time scale 1)."""
    config = SimulatorConfig()
    return iteration_cost(config).decode_step_ms(config.max_batch, config.max_batch * PRIOR_PROMPT_TOKENS)


def predicted_ttft(
    groups: list[EndpointGroup], slo_ms: float, time_scale: float, **knobs: Any
) -> PredictedTtftPolicy:
    """``predicted_ttft`` with every time setting at the replicas' time scale."""
    settings = PredictedTtftSettings(
        groups=groups,
        slo_ms=slo_ms * time_scale,
        first_token_floor_ms=first_token_floor_ms() * time_scale,
        **knobs,
    )
    return PredictedTtftPolicy(settings)


# ---- scenarios -------------------------------------------------------------------------------------
async def mixed(args: argparse.Namespace) -> tuple[list[Run], dict[str, Goodput]]:
    """Every policy at every ``--rates`` rate, or (``--search``) each policy's goodput searched; the
    runs, and the searched goodput per policy (empty for a ladder)."""
    scale = args.time_scale
    runs: list[Run] = []
    searched: dict[str, Goodput] = {}
    async with (
        SimulatorFleet(4, "--time-scale", str(scale)) as fast,
        SimulatorFleet(2, "--time-scale", str(scale), "--slowdown", "2") as slow,
    ):
        urls = [*fast.urls, *slow.urls]
        prior = h100_ms_per_token() * scale

        async def measure(setup: str, rate: float, repeat: int) -> Run:
            if setup == "predicted_ttft":
                group = EndpointGroup(name="local", endpoints=urls, ms_per_token=prior)
                policy: Any = predicted_ttft([group], args.slo_ms, scale, **json.loads(args.knobs))
            else:
                policy = make_policy(setup)
            run = Run("mixed", setup, rate, repeat=repeat)
            timed = with_poisson_arrivals(
                trace(int(rate * args.seconds), args.seed, args.max_tokens), rate, seed=repeat
            )
            timed = [replace(r, t=r.t) for r in timed if r.t < args.seconds]
            # The degradation detector compares a replica with all its peers, so under load it
            # drains the slow kind (3x the median latency per unit of work, queueing included) and
            # takes a third of this fleet's capacity from whichever policy loads them: off here, so
            # the policies are compared on the same six replicas (docs/routing.md).
            detector = DegradationDetector(DegradationSettings(enabled=False))
            async with LLMClient(client_config(urls), policy, degradation=detector) as client:
                await client.wait_until_healthy()
                names = {e.url: e.name for e in client.endpoints}
                group_of = {names[u]: ("slow" if u in slow.urls else "fast") for u in urls}
                await replay(run, client, timed, group_of)
            runs.append(run)
            print(
                f"  mixed {setup} @ {rate:.2f}/s r{repeat}: {len(run.samples)} requests; {diagnosis(run)}",
                flush=True,
            )
            for fleet in (fast, slow):  # a fresh cache for the next run
                await _reset(fleet.urls)
            return run

        slo = args.slo_ms * scale
        if args.search:
            low, high = args.search
            plan = SearchPlan(low, high, low / 4, high * 2, args.tolerance, args.repeats)
            for setup in args.policies:

                async def probe(rate: float, repeat: int, setup: str = setup) -> Run:
                    return await measure(setup, rate, repeat)

                meets = {"slo": lambda run: meets_slo(run, slo)}
                searched[setup] = (await GoodputSearch(probe, meets, plan).run())["slo"]
        else:
            for rate in args.rates:
                for setup in args.policies:
                    await measure(setup, rate, 0)
    return runs, searched


def meets_slo(run: Run, slo_ms: float) -> bool:
    """p99 TTFT within the SLO and every request answered."""
    return all(s.ok for s in run.samples) and percentile(run.ttfts(), 0.99) <= slo_ms


async def regions(args: argparse.Namespace, *, lose: bool) -> list[Run]:
    scale = args.time_scale
    runs = []
    async with (
        SimulatorFleet(3, "--time-scale", str(scale)) as west,
        SimulatorFleet(3, "--time-scale", str(scale), "--network-rtt-ms", str(args.rtt_ms)) as east,
    ):
        prior = h100_ms_per_token() * scale
        groups = [
            EndpointGroup(name="west", endpoints=west.urls, ms_per_token=prior),
            EndpointGroup(name="east", endpoints=east.urls, rtt_ms=args.rtt_ms, ms_per_token=prior),
        ]
        rate = args.rates[0]
        requests = trace(int(rate * args.seconds * args.surge), args.seed, args.max_tokens)
        setups = [("spill-over", 1.0), ("no spill-over", 0.0), ("no surge", 1.0)]
        if lose:
            setups = [(f"{args.lose} lost mid-run", 1.0)]
        surged = surge_arrivals(requests, rate, args.surge, args.seconds)
        for setup, east_weight in setups:
            policy = predicted_ttft(
                groups, args.slo_ms, scale, local_group="west", min_spill_s=args.min_spill_s
            )
            policy.set_group_weight("east", east_weight)
            run = Run("lost" if lose else "surge", setup, rate)
            # Without the surge: the same prompts at the base rate all along (a longer run), so the
            # prefill tokens per request compare the same shoppers' same prompts.
            calm = setup == "no surge"
            timed = with_poisson_arrivals(surged, rate, seed=int(rate * 1000)) if calm else surged
            async with LLMClient(client_config([*west.urls, *east.urls]), policy) as client:
                await client.wait_until_healthy()
                group_of = {e.name: ("east" if e.url in east.urls else "west") for e in client.endpoints}
                victim = east if args.lose == "east" else west
                killer = asyncio.create_task(_kill_later(victim, args.seconds / 2)) if lose else None
                await replay(run, client, timed, group_of)
                if killer is not None:
                    await killer
            runs.append(run)
            print(f"  {run.scenario} {setup}: {len(run.samples)} requests", flush=True)
            if not lose:
                await _reset([*west.urls, *east.urls])
    return runs


def diagnosis(run: Run) -> str:
    """One line of why: cache hits, load-guard decisions, learned slowness, drains."""
    st = run.stats
    parts = [
        f"hits {st.get('cache_hits', '-')}/{st.get('decisions', '-')}",
        f"imbalance {st.get('imbalance_fallbacks', '-')}",
        f"bounded {st.get('bounded_load_skips', '-')}",
        f"queue-cap {st.get('queue_cap_skips', '-')}",
        f"drains {sum(' drained' in c for c in st.get('drains', []))}",
    ]
    if "slowness" in st:
        parts.append("slowness " + " ".join(f"{v:.2f}" for v in st["slowness"].values()))
    return ", ".join(parts)


async def _kill_later(fleet: SimulatorFleet, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    for i in range(fleet.count):
        fleet.kill(i)


async def _reset(urls: Sequence[str]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(f"{url}/admin/reset_cache") as response:
                await response.read()


# ---- report ----------------------------------------------------------------------------------------
def report(runs: Sequence[Run], args: argparse.Namespace, searched: dict[str, Goodput] | None = None) -> str:
    rng = random.Random(1)
    slo = args.slo_ms * args.time_scale
    out = []
    if any(r.scenario == "mixed" for r in runs):
        rows = []
        for run in runs:
            values = run.ttfts()
            lo, hi = bootstrap_p99(values, rng)
            slow_share = sum(s.group == "slow" for s in run.samples if s.ok) / max(1, len(values))
            rows.append(
                [run.setup, run.rate, len(run.samples), f"{percentile(values, 0.5):.0f}",
                 f"{percentile(values, 0.99):.0f} [{lo:.0f}, {hi:.0f}]", f"{slow_share:.2f}",
                 sum(not s.ok for s in run.samples)]
            )  # fmt: skip
        out.append(print_table(["policy", "rate/s", "requests", "TTFT p50 ms", "TTFT p99 ms [95% CI]",
                                "share on slow", "errors"], rows))  # fmt: skip
        if searched:
            out.append(searched_table(searched, slo))
        else:
            goodput = []
            for setup in args.policies:
                meeting = [r.rate for r in runs if r.setup == setup and percentile(r.ttfts(), 0.99) <= slo]
                goodput.append([setup, max(meeting, default=0.0), f"{max(meeting, default=0.0) / 6:.2f}"])
            out.append(
                print_table(
                    [f"policy (SLO p99 TTFT <= {slo:.0f} ms)", "goodput req/s", "per replica"], goodput
                )
            )
    for run in (r for r in runs if r.scenario in ("surge", "lost")):
        third = args.seconds / 3
        surge = run.ttfts(third, 2 * third)
        lo, hi = bootstrap_p99(surge, rng)
        answered = [s for s in run.samples if s.ok]
        east = sum(s.group == "east" for s in answered) / max(1, len(answered))
        prefill = sum(s.prefill_tokens for s in answered) / max(1, len(answered))
        line = (
            f"{run.scenario} | {run.setup}: {len(run.samples)} prompts, {len(answered)} answered, "
            f"{len(run.samples) - len(answered)} errors; surge-window TTFT p99 "
            f"{percentile(surge, 0.99):.0f} ms [{lo:.0f}, {hi:.0f}], whole run p99 "
            f"{percentile(run.ttfts(), 0.99):.0f} ms; share east {east:.2f}; prefill tokens/request "
            f"{prefill:.0f}; spills {run.stats.get('spills')} returns {run.stats.get('returns')}; "
            f"while spilled {run.stats.get('spilled_requests')} sent out, "
            f"{run.stats.get('kept_local_while_spilled')} kept local"
        )
        print(line)
        out.append(line)
        if run.scenario == "lost":
            seconds = int(args.seconds)
            per_s = [sum(1 for s in run.samples if int(s.t) == t and s.ok) for t in range(seconds)]
            errs = [sum(1 for s in run.samples if int(s.t) == t and not s.ok) for t in range(seconds)]
            for label, counts in (("answered", per_s), ("errors", errs)):
                line = f"{label} per second (by arrival): " + " ".join(map(str, counts))
                print(line)
                out.append(line)
            out.append(print_table(*windows(run, args.seconds, args.lose)))
    return "\n\n".join(out)


def searched_table(searched: dict[str, Goodput], slo: float) -> str:
    """Searched goodput per policy (median [interval]), and each pair's verdict: a win only where the
    intervals separate."""
    rows: list[list[object]] = [
        [setup, goodput_cell(g), goodput_cell(g, scale=6)] for setup, g in searched.items()
    ]
    text = print_table(
        [f"policy (SLO p99 TTFT <= {slo:.0f} ms)", "goodput req/s [interval]", "per replica"], rows
    )
    names = list(searched)
    verdicts = {1: "{a} beats {b} (intervals separate)", -1: "{b} beats {a} (intervals separate)"}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            side = separates(searched[a], searched[b])
            line = verdicts.get(side, "{a} and {b}: a tie (intervals overlap)").format(a=a, b=b)
            print(line)
            text += "\n" + line
    return text


def windows(
    run: Run, seconds: float, region: str, width: float = 5.0
) -> tuple[list[str], list[list[object]]]:
    """Per ``width`` seconds of arrivals: answered, errors, the share the survivors answered, TTFT p50
    and p99. How soon the surviving regions take the load shows here."""
    survivors = "west" if region == "east" else "east"
    rows: list[list[object]] = []
    start = 0.0
    while start < seconds:
        window = [s for s in run.samples if start <= s.t < start + width]
        ttfts = [s.ttft_ms for s in window if s.ok]
        took = sum(s.group == survivors for s in window if s.ok) / max(1, len(ttfts))
        rows.append(
            [f"{start:.0f}-{start + width:.0f} s", len(ttfts), len(window) - len(ttfts), f"{took:.2f}",
             f"{percentile(ttfts, 0.5):.0f}", f"{percentile(ttfts, 0.99):.0f}"]
        )  # fmt: skip
        start += width
    return [
        "arrivals",
        "answered",
        "errors",
        f"share answered in {survivors}",
        "TTFT p50 ms",
        "TTFT p99 ms",
    ], rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.regions", description=__doc__)
    parser.add_argument("--scenario", choices=["mixed", "surge", "lost"], default="mixed")
    parser.add_argument(
        "--rates", default="6,10,14", help="requests/s (surge, lost: the first, before the surge)"
    )
    parser.add_argument("--policies", default="round_robin,least_outstanding,prefix_aware,predicted_ttft")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--slo-ms", type=float, default=1000.0, help="p99 TTFT target (simulated ms)")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--surge", type=float, default=3.0)
    parser.add_argument(
        "--lose", choices=["east", "west"], default="east", help="lost: the region killed at half time"
    )
    parser.add_argument(
        "--min-spill-s", type=float, default=15.0, help="as long as the surge: 5 s flapped (docs/routing.md)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    add_search_arguments(
        parser,
        bracket_help="mixed: search each policy's goodput from this first bracket (requests/s) instead of "
        "--rates",
        repeats_help="--search: searches per policy",
    )
    parser.add_argument("--knobs", default="{}", help="predicted_ttft settings (JSON) for the mixed fleet")
    parser.add_argument(
        "--tag", default="", help="results file suffix: regions_<scenario><tag>.json (a variant kept apart)"
    )
    parser.add_argument(
        "--report-from", type=Path, help="print the report of this results JSON again (same options)"
    )
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in str(args.rates).split(",")]
    args.policies = str(args.policies).split(",")
    return args


def load_runs(path: Path) -> list[Run]:
    """The runs of an earlier results JSON, to print its report again (``--report-from``)."""
    payload = json.loads(path.read_text())
    return [
        Run(
            r["scenario"],
            r["setup"],
            r["rate"],
            [Sample(**s) for s in r["samples"]],
            r["stats"],
            r.get("repeat", 0),
        )
        for r in payload["runs"]
    ]


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report_from is not None:
        report(load_runs(args.report_from), args)
        return
    searched: dict[str, Goodput] = {}
    if args.scenario == "mixed":
        runs, searched = await mixed(args)
    else:
        runs = await regions(args, lose=args.scenario == "lost")
    text = report(runs, args, searched)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"lost_{args.lose}" if args.scenario == "lost" else args.scenario
    path = RESULTS / f"regions_{name}{args.tag}.json"
    payload = {
        "machine": machine(),
        "args": vars(args),
        "report": text,
        "runs": [asdict(r) for r in runs],
        "searched": {setup: [asdict(b) for b in g.brackets] for setup, g in searched.items()},
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
