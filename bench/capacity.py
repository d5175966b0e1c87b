"""Capacity shifting benchmark: a 24-hour real-time traffic curve, compressed, on one replica pool shared
with a batch job.

Set-up: a throwaway stack with ``--replicas`` simulator replicas; ``shopper realtime serve
--shift-capacity`` (the controller runs in the service, driven by its measured request rate) and
``shopper batch submit --follow-pool`` (a long job that takes whatever real-time leaves) as separate
processes; this process sends open-loop real-time traffic following the day's curve (Poisson
arrivals, rate changing every second) and samples, once a second, the published split and the batch
job's progress.

The curve (``DAY``) has a night trough, a morning ramp, a midday plateau and an evening peak. One
simulated hour lasts ``--seconds`` / 24. Batch calls are capped at ``--batch-per-replica`` in flight per
replica so that the two-core machine's CPU, not the replicas, stays out of the way: each replica would
otherwise take about 150 batch calls/s at this time scale and batch throughput would show the CPU.

``--static N`` runs the same day with a fixed split (N replicas real-time, the rest batch) instead.

Prints a table per part of the day; writes bench/results/capacity.json and capacity.png (replicas per
pool, real-time p99 and degraded share, batch throughput).

Usage:
  .venv/bin/python -m bench.capacity                 # shifting, 240 s day (about 5 minutes)
  .venv/bin/python -m bench.capacity --static 3      # the same day with a fixed 3/3 split
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from batch.coordination import read_progress
from batch.storage import JobStore, S3Uri
from batch.synthetic import synthetic_product_lines
from bench.common import REPO, machine, percentile, print_table, results_dir, temporary_stack
from bench.realtime import Sample, _body, _calibrate, _write_signals
from capacity.pool import PoolBoard, SharedPool
from devstack.served_process import start_realtime_service
from devstack.stack import sink_settings

RESULTS = results_dir()
POOL = "bench-pool"

# Real-time requests/s at each hour of the day, as a share of the peak (linear in between).
DAY = [0.18, 0.14, 0.12, 0.11, 0.12, 0.16, 0.25, 0.38, 0.50, 0.58, 0.62, 0.64,
       0.66, 0.64, 0.62, 0.62, 0.66, 0.75, 0.88, 0.97, 1.00, 0.90, 0.62, 0.32]  # fmt: skip
PARTS = [
    ("night 00-06", 0, 6),
    ("morning 06-12", 6, 12),
    ("afternoon 12-18", 12, 18),
    ("evening 18-24", 18, 24),
]


def share_at(hour: float) -> float:
    h = hour % 24
    i = int(h)
    return DAY[i] + (DAY[(i + 1) % 24] - DAY[i]) * (h - i)


async def _day_traffic(
    url: str, seconds: float, peak_rps: float, deadline_ms: int, products: list[str], shoppers: int
) -> list[Sample]:
    """Open loop: Poisson arrivals at the curve's rate (re-read every arrival)."""
    rng = random.Random(5)
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session:

        async def one(scheduled: float, body: bytes) -> None:
            status, reason, llm_ms = 0, None, None
            try:
                async with session.post(
                    url + "/v1/match", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    raw = await r.read()
                    status = r.status
                if status == 200:
                    answer = orjson.loads(raw)
                    reason, llm_ms = answer["degraded_reason"], answer["llm_ms"]
            except (aiohttp.ClientError, TimeoutError):
                status = -1
            samples.append(
                Sample(scheduled, 0.0, (loop.time() - scheduled) * 1000, status, reason, llm_ms, deadline_ms)
            )

        start = loop.time()
        at = start
        tasks: list[asyncio.Task[None]] = []
        while at < start + seconds and len(tasks) < peak_rps * seconds:
            rate = max(peak_rps * share_at(24 * (at - start) / seconds), 0.5)
            body = _body(rng, products, shoppers, deadline_ms)
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(at, body)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    for s in samples:
        s.scheduled -= start
    return samples


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"bench-cap-{int(time.time())}:"
    load_before = os.getloadavg()
    timeline: list[dict[str, Any]] = []
    with temporary_stack(replicas=args.replicas, time_scale=args.time_scale) as stack:
        stack_dir = Path(stack.processes[0].log).parent.parent
        sinks = sink_settings(stack, redis_key_prefix=prefix)
        products = await _write_signals(stack, prefix, args.shoppers)
        input_uri = f"s3://{sinks.s3_bucket}/bench-capacity/input.jsonl"
        async with JobStore(sinks) as store:
            lines = synthetic_product_lines(args.batch_records, seed=3, long_share=0.0, bad_share=0.0)
            await store.put(S3Uri.parse(input_uri), b"\n".join(lines) + b"\n", "application/x-ndjson")
        redis = aioredis.Redis.from_url(stack.redis_url)
        board = PoolBoard(redis, prefix, SharedPool(POOL, stack.llm_endpoints))
        env = {
            "SINK_REDIS_KEY_PREFIX": prefix,
            "REALTIME_LLM_CONCURRENCY_PER_REPLICA": str(args.per_replica),
            "BATCH_PER_REPLICA_BUDGET": str(args.batch_per_replica),
            "CAPACITY_PER_REPLICA_RPS": str(args.per_replica_rps),
            "CAPACITY_HEADROOM": "0.3",
            "CAPACITY_LEAD_S": str(args.seconds / 24),  # one simulated hour ahead
            "CAPACITY_TREND_WINDOW_S": str(args.seconds / 24),
            "CAPACITY_SCALE_DOWN_AFTER_S": str(args.seconds / 48),  # half an hour
            "CAPACITY_STEP_INTERVAL_S": str(args.seconds / 96),
            # The default 1 s tick at the documented 240 s day; a shorter day ticks faster, so the trend
            # window (one simulated hour) still covers the two ticks the controller needs.
            "CAPACITY_TICK_S": str(min(1.0, args.seconds / 240)),
            "CAPACITY_LOAD_WINDOW_S": "3",
            "CAPACITY_HANDOFF_S": "1",
        }
        state = ["--state-dir", str(stack_dir)]
        if args.static is None:
            serve = ["--shift-capacity", POOL, *state]
        else:
            await board.publish(args.static)  # a fixed split that nothing changes
            serve = ["--replicas", str(args.static), *state]
        service = await start_realtime_service(serve, env, REPO)
        url = service.url
        job_id = f"bench-capacity-{int(time.time())}"
        submit = [sys.executable, "-m", "shopper", "batch", "submit", "--input", input_uri,
                  "--output", f"s3://{sinks.s3_bucket}/bench-capacity/out",
                  "--job-id", job_id, "--follow-pool", POOL, *state]  # fmt: skip
        worker = await asyncio.create_subprocess_exec(  # its progress is read from Redis, not its output
            *submit, cwd=REPO, env={**os.environ, **env},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            slowdown = await _calibrate(url, stack, args.llm_ms, products, args.shoppers)
            print(f"replica slowdown {slowdown:.3f} for ~{args.llm_ms:.0f} ms ranking calls", flush=True)
            await asyncio.sleep(3)  # the batch job ramps up on the night split

            async def sample_pool() -> None:
                started = time.monotonic()
                while True:
                    split = await board.read()
                    progress = await read_progress(redis, prefix, job_id) or {}
                    timeline.append(
                        {
                            "t": round(time.monotonic() - started, 2),
                            "realtime": split.realtime if split else None,
                            "batch_done": progress.get("done"),
                            "batch_limit": progress.get("limit"),
                        }
                    )
                    await asyncio.sleep(1.0)

            sampler = asyncio.create_task(sample_pool())
            samples = await _day_traffic(
                url, args.seconds, args.peak_rps, args.deadline_ms, products, args.shoppers
            )
            sampler.cancel()
        finally:
            if worker.returncode is None:
                worker.terminate()
            await service.stop(timeout_s=20)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):
                    await worker.wait()
            keys = [k async for k in redis.scan_iter(match=f"{prefix}*", count=1000)]
            if keys:
                await redis.delete(*keys)
            await redis.aclose()
    return summarise(args, samples, timeline, slowdown, load_before)


def summarise(
    args: argparse.Namespace,
    samples: list[Sample],
    timeline: list[dict[str, Any]],
    slowdown: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    hour_s = args.seconds / 24

    done = [(p["t"], p["batch_done"]) for p in timeline if p["batch_done"] is not None]

    def batch_done_at(t: float) -> float:
        """Records the batch job had done at ``t`` (linear between samples)."""
        if not done or t <= done[0][0]:
            return float(done[0][1]) if done else 0.0
        for (ta, da), (tb, db) in itertools.pairwise(done):
            if ta <= t <= tb:
                return float(da + (db - da) * (t - ta) / max(tb - ta, 1e-9))
        return float(done[-1][1])

    def batch_rate(t0: float, t1: float) -> float:
        return (batch_done_at(t1) - batch_done_at(t0)) / max(t1 - t0, 1e-9)

    parts = []
    for name, h0, h1 in PARTS:
        t0, t1 = h0 * hour_s, h1 * hour_s
        part = [s for s in samples if t0 <= s.scheduled < t1]
        held = [p["realtime"] for p in timeline if t0 <= p["t"] < t1 and p["realtime"] is not None]
        parts.append(
            {
                "part": name,
                "rt_rps": round(len(part) / (t1 - t0), 1),
                "rt_replicas_min": min(held) if held else None,
                "rt_replicas_max": max(held) if held else None,
                "rt_p99_ms": round(percentile([s.latency_ms for s in part], 0.99), 1),
                "degraded_pct": round(100 * sum(1 for s in part if s.degraded_reason) / max(len(part), 1), 2),
                "late": sum(1 for s in part if s.latency_ms > s.deadline_ms),
                "errors": sum(1 for s in part if s.status != 200),
                "batch_records_per_s": round(batch_rate(t0, t1), 1),
            }
        )
    buckets = []
    bucket_s = hour_s / 2
    for k in range(48):
        t0, t1 = k * bucket_s, (k + 1) * bucket_s
        part = [s for s in samples if t0 <= s.scheduled < t1]
        buckets.append(
            {
                "t": round(t0, 2),
                "rps": round(len(part) / bucket_s, 1),
                "p99_ms": round(percentile([s.latency_ms for s in part], 0.99), 1) if part else None,
                "degraded_pct": round(100 * sum(1 for s in part if s.degraded_reason) / max(len(part), 1), 2),
                "batch_records_per_s": round(batch_rate(t0, t1), 1),
            }
        )
    held = [p["realtime"] for p in timeline if p["realtime"] is not None]
    return {
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "mode": "shifting" if args.static is None else f"static {args.static}/{args.replicas - args.static}",
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "slowdown": round(slowdown, 3),
        "day_seconds": args.seconds,
        "peak_rps": args.peak_rps,
        "per_replica_rps": args.per_replica_rps,
        "requests": len(samples),
        "late": sum(1 for s in samples if s.latency_ms > s.deadline_ms),
        "errors": sum(1 for s in samples if s.status != 200),
        "degraded_pct": round(100 * sum(1 for s in samples if s.degraded_reason) / max(len(samples), 1), 2),
        "rt_p99_ms": round(percentile([s.latency_ms for s in samples], 0.99), 1),
        "rt_replicas_min": min(held),
        "rt_replicas_max": max(held),
        # Between the first and the last sample that read the job's progress (a sample can find none).
        "batch_records": done[-1][1] - done[0][1] if done else 0,
        "parts": parts,
        "buckets": buckets,
        "timeline": timeline,
    }


def report(result: dict[str, Any]) -> None:
    loads = f"{result['load_average_before']} -> {result['load_average_after']}"
    print(f"\nmachine: {result['machine']}; load average {loads}")
    day = f"a day in {result['day_seconds']:.0f} s"
    peak = f"real-time peak {result['peak_rps']:.0f} req/s"
    print(f"{result['mode']}: {result['replicas']} replicas, {day}, {peak}, {result['requests']} requests\n")
    rows = [
        [p["part"], p["rt_rps"], f"{p['rt_replicas_min']}-{p['rt_replicas_max']}", p["rt_p99_ms"],
         p["degraded_pct"], p["late"], p["errors"], p["batch_records_per_s"]]
        for p in result["parts"]
    ]  # fmt: skip
    print_table(
        [
            "part of day",
            "rt req/s",
            "rt replicas",
            "rt p99 ms",
            "degraded %",
            "late",
            "errors",
            "batch rec/s",
        ],
        rows,
    )
    held = f"{result['rt_replicas_min']}-{result['rt_replicas_max']}"
    print(
        f"\nwhole day: rt p99 {result['rt_p99_ms']} ms, degraded {result['degraded_pct']}%, "
        f"late {result['late']}, errors {result['errors']}; real-time held {held} replicas; "
        f"batch did {result['batch_records']} records"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hour_s = result["day_seconds"] / 24
    timeline = [p for p in result["timeline"] if p["realtime"] is not None]
    hours = [p["t"] / hour_s for p in timeline]
    rt = [p["realtime"] for p in timeline]
    batch = [result["replicas"] - r for r in rt]
    buckets = result["buckets"]
    bh = [b["t"] / hour_s + 0.25 for b in buckets]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax = axes[0]
    labels = ["real-time replicas", "batch replicas"]
    ax.stackplot(hours, rt, batch, labels=labels, colors=["tab:red", "tab:blue"], alpha=0.5, step="post")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, result["replicas"])
    load = ax.twinx()
    load.plot(bh, [b["rps"] for b in buckets], color="black", label="real-time req/s")
    load.set_ylabel("real-time req/s")
    ax.legend(loc="upper left", fontsize=8)
    load.legend(loc="upper right", fontsize=8)
    ax.set_title(f"capacity shifting ({result['mode']}), one day in {result['day_seconds']:.0f} s")
    ax = axes[1]
    ax.plot(bh, [b["p99_ms"] for b in buckets], color="tab:red", label="real-time p99 (client, ms)")
    ax.axhline(300, color="gray", linestyle="--", label="deadline")
    ax.set_ylabel("ms")
    deg = ax.twinx()
    deg.bar(
        bh, [b["degraded_pct"] for b in buckets], width=0.4, color="tab:orange", alpha=0.4, label="degraded %"
    )
    deg.set_ylabel("degraded %")
    deg.set_ylim(0, max(10, max(b["degraded_pct"] for b in buckets) * 1.2))
    ax.legend(loc="upper left", fontsize=8)
    deg.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    ax.plot(bh, [b["batch_records_per_s"] for b in buckets], color="tab:blue", label="batch records/s")
    ax.set_ylabel("records / s")
    ax.set_xlabel("hour of the simulated day")
    ax.set_xticks(range(0, 25, 3))
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=240.0, help="length of the simulated day")
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--peak-rps", type=float, default=100.0)
    parser.add_argument(
        "--per-replica-rps", type=float, default=25.0, help="controller: rt req/s per replica"
    )
    parser.add_argument("--per-replica", type=int, default=16, help="rt calls admitted per replica")
    parser.add_argument("--batch-per-replica", type=int, default=2, help="batch calls in flight per replica")
    parser.add_argument("--batch-records", type=int, default=60_000)
    parser.add_argument("--time-scale", type=float, default=0.03)
    parser.add_argument("--llm-ms", type=float, default=150.0)
    parser.add_argument("--deadline-ms", type=int, default=300)
    parser.add_argument("--shoppers", type=int, default=500)
    parser.add_argument(
        "--static", type=int, default=None, help="fixed real-time replicas instead of shifting"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or ("capacity" if args.static is None else f"capacity_static_{args.static}")
    result = asyncio.run(bench(args))
    report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{out}.png")
    print(f"\nwrote {RESULTS / out}.json and {out}.png")


if __name__ == "__main__":
    main()
