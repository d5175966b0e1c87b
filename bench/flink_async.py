"""PyFlink async operator throughput and added latency, with the job's own ``EnrichPrompts`` calling a
fixed-latency OpenAI-compatible endpoint (a tiny aiohttp server in this process).

    .venv/bin/python bench/flink_async.py                  # the table in docs/flink.md
    .venv/bin/python bench/flink_async.py --quick          # two rows, as a smoke test
    .venv/bin/python bench/flink_async.py --defaults       # the job's current defaults, 200 ms and 1 s calls
    .venv/bin/python bench/flink_async.py --defaults --paced-load 0.5,0.7,0.9   # freshness near the ceiling

The table it prints goes to ``bench/results/flink_async.json`` (``flink_async_defaults.json`` with
``--defaults``, ``flink_async_quick.json`` with ``--quick``, or ``--out``) with the machine and load
average; ``docs/`` renders it from there.

Choosing rows: ``--quick`` (optionally narrowed by ``--only``), ``--rows`` or ``--defaults`` (optionally
with ``--bundle-ms``); ``--rows`` and ``--defaults`` each take the whole choice, so they refuse the others.

Each setting runs twice in the local MiniCluster:
- saturated: the whole input is available at once; events/s = prompts completed per second between the
  first call and the last completion, against the Little's-law ceiling capacity / latency;
- paced: a rate-limited Java source offers ``--paced-load`` x ceiling prompts/s; added latency = time
  from a prompt's scheduled offer to its receipt by the next (Python) operator, minus the call's own
  latency (p50/p99). It includes one Java->Python->Java->Python round; the first row is that floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from pyflink.datastream.functions import AsyncFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_results
from flink_jobs.flink_config import AsyncSettings, NearRealtimeSettings
from llm_client.config import ClientConfig, HealthSettings, RetrySettings, Timeouts
from pipeline.enrichment import EnrichmentSettings
from pipeline.overload import OverloadSettings
from prompt_assembly.records import PromptRequest
from sinks.config import SinkSettings

ANSWER = orjson.dumps(
    {
        "interests": ["trail running"],
        "occasion": None,
        "style": "outdoor",
        "price_sensitivity": "medium",
        "summary": "Runs trails and compares mid-priced shoes.",
    }
).decode()


# ---- fixed-latency endpoint ------------------------------------------------------------------------
class FixedLatencyLLM:
    """``POST /v1/chat/completions`` answers after ``latency_s``; ``GET /health``. Non-streaming."""

    def __init__(self) -> None:
        self.latency_s = 0.2
        self.port = _free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port, backlog=4096)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(self.latency_s)
        body = {
            "model": "fixed-latency",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": 600,
                "completion_tokens": 40,
                "prompt_tokens_details": {"cached_tokens": 512},
            },
        }
        return web.json_response(body)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the job under test -------------------------------------------------------------------------------
class SleepCall(AsyncFunction):
    """The operator alone: each call is ``asyncio.sleep(latency)`` (no HTTP, no parsing beyond the id)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def async_invoke(self, value: str) -> list[str]:
        started = time.time()
        await asyncio.sleep(self.latency_s)
        request_id = orjson.loads(value)["request_id"]
        done = time.time()
        return [
            orjson.dumps(
                {
                    "request_id": request_id,
                    "produced_at": done,
                    "latency_ms": (done - started) * 1000,
                    "kind": "insight",
                }
            ).decode()
        ]


@dataclass(frozen=True)
class Setting:
    label: str
    call: str
    """"sleep": the operator alone; "http": the job's EnrichPrompts against the fixed-latency endpoint."""
    latency_s: float
    capacity: int
    bundle_time_ms: int
    bundle_size: int = 100_000
    timeout_ms: int = 60_000
    paced_rate: float | None = None
    """Offered load of the paced run; default ``--paced-load`` x ceiling."""

    @property
    def ceiling(self) -> float:
        return self.capacity / self.latency_s


def _prompts(n: int) -> list[str]:
    messages = [
        {"role": "system", "content": "You describe shoppers."},
        {"role": "user", "content": "events"},
    ]
    out = []
    for i in range(n):
        prompt = PromptRequest(
            request_id=f"b-{i}-T",
            shopper_id=f"s{i % 5000}",
            seq=1,
            reason="browse_pause",
            messages=messages,
            event_count=3,
            last_event_ts=time.time(),
            prompt_tokens=600,
            shared_prefix_tokens=0,
        )
        out.append(prompt.model_dump_json())
    return out


def paced_source(env: Any, values: list[str], rate: float) -> Any:
    """A Java-side bounded source emitting ``values`` at ``rate``/s (0 = unthrottled): Flink's
    DataGeneratorSource over the elements, so no Python stage sits between the pacing and the operator."""
    from pyflink.common import Types, WatermarkStrategy
    from pyflink.datastream.connectors import Source
    from pyflink.java_gateway import get_gateway

    gateway = get_gateway()
    jvm = gateway.jvm
    array = gateway.new_array(jvm.java.lang.Object, len(values))
    for i, value in enumerate(values):
        array[i] = value
    type_info = Types.STRING().get_java_type_info()
    generator = jvm.org.apache.flink.connector.datagen.functions.FromElementsGeneratorFunction(
        type_info, array
    )
    limiter = jvm.org.apache.flink.api.connector.source.util.ratelimit.RateLimiterStrategy
    strategy = limiter.perSecond(float(rate)) if rate > 0 else limiter.noOp()
    j_source = jvm.org.apache.flink.connector.datagen.source.DataGeneratorSource(
        generator, len(values), strategy, type_info
    )
    return env.from_source(Source(j_source), WatermarkStrategy.no_watermarks(), "prompts", Types.STRING())


def _stamp(value: str) -> str:
    return f"{time.time():.6f}|{value}"


def run_once(setting: Setting, url: str, n: int, rate: float) -> dict[str, float]:
    from pyflink.common import Types
    from pyflink.common.time import Time
    from pyflink.datastream.async_data_stream import AsyncDataStream

    from flink_jobs.flink_functions import EnrichPrompts
    from flink_jobs.near_realtime import async_stage, create_environment

    settings = NearRealtimeSettings(
        job_name=f"bench {setting.label}",
        async_io=AsyncSettings(
            capacity=setting.capacity,
            bundle_time_ms=setting.bundle_time_ms,
            bundle_size=setting.bundle_size,
            timeout_ms=60_000,
        ),
        llm=ClientConfig(
            endpoints=[url],
            stream=False,
            max_in_flight=setting.capacity,
            timeouts=Timeouts(connect_s=5, attempt_s=60, deadline_s=120),
            retry=RetrySettings(max_attempts=1),
            health=HealthSettings(interval_s=5),
        ),
        sinks=SinkSettings(enabled=()),  # the async stage alone: no sinks
        # The admission gate as wide as Flink's capacity: the one fixed-latency endpoint is one "replica"
        # to pipeline.overload, whose adaptive limit (at most 64 a replica) would otherwise bind before
        # the operator does, and drop what waits past its freshness budget as stale.
        enrichment=EnrichmentSettings(overload=OverloadSettings(max_in_flight=setting.capacity)),
    )
    settings.checkpoint.interval_ms = 3_600_000
    env = create_environment(settings, local=True)

    paced = paced_source(env, _prompts(n), rate)
    call = SleepCall(setting.latency_s) if setting.call == "sleep" else EnrichPrompts(settings.to_json())
    # Both Python operators as process-mode workers, as the job's async stage is (whatever the job's
    # session_stage_mode says), so rows stay comparable with the earlier ones.
    with async_stage(paced):
        results = AsyncDataStream.unordered_wait(
            paced,
            call,
            Time.milliseconds(setting.timeout_ms),  # 0 = no Flink-level timeout (no timer thread per call)
            capacity=setting.capacity,
            output_type=Types.STRING(),
        )
        stamped = results.map(_stamp, output_type=Types.STRING())
    rows = []
    with stamped.execute_and_collect(settings.job_name) as records:
        for record in records:
            received, raw = record.split("|", 1)
            result = orjson.loads(raw)
            index = int(result["request_id"].split("-")[1])
            done = result["produced_at"]
            # an error or superseded result carries no call latency; it counts as an error below
            call_s = (result.get("latency_ms") or 0) / 1000
            rows.append((index, done - call_s, done, float(received), call_s, result["kind"]))
    errors = sum(1 for r in rows if r[5] != "insight")
    kinds = sorted({r[5] for r in rows if r[5] != "insight"})
    if errors:
        print(f"  {errors} of {len(rows)} results are not insights ({', '.join(kinds)})", flush=True)
    first_call = min(r[1] for r in rows)
    last_done = max(r[2] for r in rows)
    # Record i is offered at t0 + i / rate; t0 is the earliest start the calls imply.
    t0 = min(r[1] - r[0] / rate for r in rows) if rate > 0 else first_call
    added = sorted(
        (r[3] - (t0 + (r[0] / rate if rate > 0 else 0.0)) - r[4]) * 1000 for r in rows if r[5] == "insight"
    )
    return {
        "n": len(rows),
        "errors": errors,
        "rate": len(rows) / (last_done - first_call),
        "p50": statistics.quantiles(added, n=100)[49],
        "p99": statistics.quantiles(added, n=100)[98],
    }


SETTINGS = [
    Setting("harness floor (paced 350/s)", "sleep", 0.002, 100, 1000, paced_rate=350.0),
    Setting("harness floor, bundle 100 ms", "sleep", 0.002, 100, 100, paced_rate=350.0),
    # The operator alone, ceiling 500/s (half of what one Python worker turns over here, see below).
    Setting("bundle 100 ms", "sleep", 0.2, 100, 100),
    Setting("bundle 1 s (PyFlink default)", "sleep", 0.2, 100, 1000),
    Setting("bundle 5 s", "sleep", 0.2, 100, 5000),
    Setting("bundle 100 ms", "sleep", 1.0, 500, 100),
    Setting("bundle 250 ms", "sleep", 1.0, 500, 250),
    Setting("bundle 1 s (PyFlink default)", "sleep", 1.0, 500, 1000),
    Setting("bundle 5 s", "sleep", 1.0, 500, 5000),
    Setting("bundle 10 s", "sleep", 1.0, 500, 10_000),
    # The operator's own CPU ceiling: capacity far above what one Python worker can turn over.
    Setting("bundle 5 s, cap 1000, Flink timeout", "sleep", 0.2, 1000, 5000),
    Setting("bundle 5 s, cap 1000, no Flink timeout", "sleep", 0.2, 1000, 5000, timeout_ms=0),
    Setting("bundle 1 s, cap 1000, no Flink timeout", "sleep", 0.2, 1000, 1000, timeout_ms=0),
    # The job's EnrichPrompts with the real client over HTTP, ceiling 250/s (CPU of this 2-core box).
    Setting("bundle 1 s, Flink timeout (PyFlink defaults)", "http", 0.2, 50, 1000),
    Setting("bundle 5 s, Flink timeout", "http", 0.2, 50, 5000),
    Setting("bundle 1 s, Flink timeout (PyFlink defaults)", "http", 1.0, 250, 1000),
    Setting("bundle 5 s, Flink timeout", "http", 1.0, 250, 5000),
    Setting("bundle 1 s, no Flink timeout (job defaults)", "http", 0.2, 50, 1000, timeout_ms=0),
    Setting("bundle 1 s, no Flink timeout (job defaults)", "http", 1.0, 250, 1000, timeout_ms=0),
    Setting("bundle 1 s, no Flink timeout, cap 1000", "http", 1.0, 1000, 1000, timeout_ms=0),
]


def job_default_settings(bundle_times_ms: list[int] | None = None) -> list[Setting]:
    """The job's EnrichPrompts at the job's current defaults (bundle time and size from
    ``AsyncSettings``, no Flink-level timeout), at 200 ms and 1 s calls: the ceiling ratio to keep.
    ``bundle_times_ms`` replaces the default bundle time with each of those in turn."""
    defaults = AsyncSettings()
    settings = []
    for bundle_ms in bundle_times_ms or [defaults.bundle_time_ms]:
        what = "job defaults" if bundle_ms == defaults.bundle_time_ms else "job defaults but"
        label = f"{what} (bundle {bundle_ms} ms)"
        settings += [
            Setting(label, "http", 0.2, 50, bundle_ms, defaults.bundle_size, timeout_ms=0),
            Setting(label, "http", 1.0, 250, bundle_ms, defaults.bundle_size, timeout_ms=0),
        ]
    return settings


CPU_BOUND_ABOVE = 1000.0
"""Ceilings above this are CPU-bound here: they get a saturated run only (a paced run would queue)."""


def _ints(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: comma-separated integers, not {text!r}")


def selected_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Setting]:
    """The rows to run, from ``--quick``, ``--only``, ``--rows``, ``--defaults`` and ``--bundle-ms``;
    a conflicting combination or an empty selection is a usage error."""
    if args.rows and (args.quick or args.only or args.defaults):
        parser.error("--rows names the rows itself: not with --quick, --only or --defaults")
    if args.defaults and (args.quick or args.only):
        parser.error("--defaults runs the job's two default rows: not with --quick or --only")
    if args.bundle_ms and not args.defaults:
        parser.error("--bundle-ms only applies with --defaults")
    if args.defaults:
        bundle_ms = _ints(args.bundle_ms, "--bundle-ms", parser) if args.bundle_ms else None
        if bundle_ms is not None and min(bundle_ms) <= 0:
            parser.error(f"--bundle-ms: positive milliseconds, not {args.bundle_ms}")
        return job_default_settings(bundle_ms)
    if args.rows:
        indices = _ints(args.rows, "--rows", parser)
        bad = [i for i in indices if not 0 <= i < len(SETTINGS)]
        if bad:
            parser.error(
                f"--rows: {', '.join(map(str, bad))} out of range; SETTINGS has rows 0-{len(SETTINGS) - 1}"
            )
        return [SETTINGS[i] for i in indices]
    pool = [SETTINGS[2], SETTINGS[-1]] if args.quick else SETTINGS
    settings = [s for s in pool if args.only in s.label] if args.only else pool
    if not settings:
        labels = "; ".join(sorted({s.label for s in pool}))
        parser.error(
            f"--only {args.only!r} matches no setting{' of --quick' if args.quick else ''}: {labels}"
        )
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="saturated run length at the ceiling")
    parser.add_argument(
        "--paced-load",
        default="0.7",
        help="offered load in paced runs / ceiling; several (0.5,0.7,0.9) give a row each",
    )
    parser.add_argument("--paced-seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="two rows, as a smoke test")
    parser.add_argument("--only", help="run settings whose label contains this (with --quick: of its two)")
    parser.add_argument(
        "--rows",
        help=f"comma-separated indices into SETTINGS (0-{len(SETTINGS) - 1}); alone, no other choice",
    )
    parser.add_argument("--defaults", action="store_true", help="only the two rows at the job's defaults")
    parser.add_argument("--bundle-ms", help="with --defaults: these bundle times (100,250,500) instead")
    parser.add_argument(
        "--out",
        help="results file name under bench/results (default flink_async.json, flink_async_defaults.json "
        "with --defaults, flink_async_quick.json with --quick)",
    )
    args = parser.parse_args()
    settings = selected_settings(args, parser)
    load_before = list(os.getloadavg())
    server = FixedLatencyLLM()
    url = server.start()
    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores (shared), "
        f"Python {platform.python_version()}, "
        "PyFlink 2.3.0 local MiniCluster, parallelism 1, "
        f"load average {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f}"
    )
    print(header)
    loads = [float(x) for x in str(args.paced_load).split(",")]
    lines = [
        "| call | latency | capacity | setting | ceiling/s | saturated events/s | ratio | paced load "
        "| paced at /s | added p50 ms | added p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    notes = []
    for setting in settings:
        server.latency_s = setting.latency_s
        n_sat = int(max(500, min(setting.ceiling, CPU_BOUND_ABOVE) * args.seconds))
        saturated = run_once(setting, url, n_sat, 0.0)
        ratio = saturated["rate"] / setting.ceiling
        prefix = (
            f"| {setting.call} | {setting.latency_s * 1000:.0f} ms | {setting.capacity} | {setting.label} "
            f"| {setting.ceiling:,.0f} |"
        )
        row = f"{prefix} {saturated['rate']:,.0f} | {ratio:.2f} |"
        paced_errors = 0
        if setting.ceiling > CPU_BOUND_ABOVE and setting.paced_rate is None:
            lines.append(row + " - | - | - | - |")
            print(lines[-1], flush=True)
        else:
            # a fixed paced rate (the harness floor) is one row; otherwise a row per offered load, the
            # saturated run shown on the first only
            rates = [setting.paced_rate] if setting.paced_rate else [x * setting.ceiling for x in loads]
            for paced_rate in rates:
                paced = run_once(setting, url, int(max(200, paced_rate * args.paced_seconds)), paced_rate)
                paced_errors += int(paced["errors"])
                lines.append(
                    f"{row} {paced_rate / setting.ceiling:.2f} | {paced_rate:,.0f} | {paced['p50']:,.0f} "
                    f"| {paced['p99']:,.0f} |"
                )
                print(lines[-1], flush=True)
                row = f"{prefix} | |"
        if saturated["errors"] or paced_errors:
            note = f"{setting.label}: errors, saturated {saturated['errors']}, paced {paced_errors}"
            notes.append(note)
            print(f"  ({note})", flush=True)
    load_end = os.getloadavg()
    print(f"load average {load_end[0]:.1f} / {load_end[1]:.1f}")
    table = "\n".join(lines + [f"\n({'; '.join(notes)})"] * bool(notes))
    default = (
        "flink_async_defaults" if args.defaults else "flink_async_quick" if args.quick else "flink_async"
    )
    name = args.out or f"{default}.json"  # a smoke run never overwrites the full run's results
    write_results(
        name,
        {
            "header": header,
            "args": vars(args),
            "load_average_start": load_before,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
