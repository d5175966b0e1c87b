"""The Flink job on the standalone cluster over Kafka (Tansu): freshness at a steady rate per setting,
throughput on a backlog against the embedded runner, and recovery from a lost TaskManager, in one run
on one machine.

    .venv/bin/python -m bench.flink_cluster [--rate 10] [--seconds 45]
        [--variants "default;bundle_time_ms=200"] [--backlog 1500]
    .venv/bin/python -m bench.flink_cluster --loads 0.5,0.7,0.9 [--ceiling-events 6000] [--own-ceiling]
        --variants "default;prompts_topic=on"
    .venv/bin/python -m bench.flink_recovery [--rate 10] [--seconds 120] [--kill-after 40]

Freshness: every event is an ``add_to_cart`` stamped with the wall clock when it is produced (its
Kafka timestamp), the job's rate limit is off, so each event is a prompt at once. A poller reads every
shopper's Redis signal (``updated_at`` is written by the sink) often enough that no write is missed
(each shopper acts every ``shoppers / rate`` s). Added latency = Redis ``updated_at`` - the event's
time - the LLM call's own ``latency_ms`` (from the S3 record): what the engine adds. It is split at the
LLM call: "to call" = the call's start (``produced_at - latency_ms``) - the event's time (Kafka fetch,
the keyed session stage's bundle, the exchange, the async stage's bundle), "write" = Redis
``updated_at`` - the call's end. The first 15 s are warm-up.

Near the ceiling (``--loads``): each variant's ceiling first, ``--ceiling-events`` add-to-carts of as
many shoppers in the topic before the job starts, nothing dropped as stale: prompts landed per second
between the 10th and 90th percentile of the Redis writes. Then the freshness stream above at each load
x the first variant's ceiling (``--own-ceiling``: x each variant's own), with the share of the offered
prompts whose signal landed. The prompts topic's runner then runs as a process of its own, as deployed.

A variant is the job's defaults with some knobs changed (``KNOBS``), e.g. ``bundle_time_ms=200,
fetch_max_wait_ms=500``; ``default`` changes nothing. Throughput: the same synthetic backlog through
the Flink job (from running to the group's committed offsets covering every record, so up to one
checkpoint interval of slack) and through the embedded runner (until drained). Recovery:
``bench/flink_recovery.py``.

The printed tables, each variant's settings and the load average before and after each part go to
``bench/results/flink_cluster.json`` (``--out`` names another file there); ``docs/`` renders them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from confluent_kafka import Producer

from bench.common import (
    machine,
    machine_busy_seconds,
    paced,
    percentile,
    print_table,
    process_group_cpu_seconds,
    write_results,
)
from bench.flink_kit import (
    WARMUP_S,
    Knobs,
    SignalPoller,
    bench_job,
    cart_event,
    describe,
    parse_variant,
    prompts_stage,
    wait_committed,
)
from devstack.flink_cluster import (
    FlinkClusterSettings,
    FlinkRest,
    cluster_down,
    cluster_up,
    submit,
)
from devstack.stack import StackSettings, StackState, sink_settings, stack_down, stack_up
from devstack.synthetic import SyntheticStream
from flink_jobs.flink_config import NearRealtimeSettings
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records


@contextlib.contextmanager
def variant_job(
    stack: StackState, state_dir: Path, spec: str, *, enrich_process: bool, saturated: bool = False
) -> Iterator[tuple[str, NearRealtimeSettings]]:
    """``(tag, settings)`` of a live job of the variant ``spec`` on topics of its own. The knob
    ``prompts_topic=on`` ends the job at its session stage, with a runner with input 'prompts' enriching
    (``bench.flink_kit.prompts_stage``) until the block ends: in this process, or with ``enrich_process``
    in a process of its own (its log in ``state_dir``). ``saturated``: nothing is dropped as stale
    (``urgent_max_wait_s`` off), so that a backlog counts the throughput, not the gate's policy."""
    tag = uuid.uuid4().hex[:8]
    knobs = parse_variant(spec)
    via_prompts_topic = knobs.pop("prompts_topic", None) is not None
    settings = bench_job(stack, state_dir, tag, knobs, live=True)
    if saturated:
        overload = settings.enrichment.overload.model_copy(update={"urgent_max_wait_s": None})
        enrichment = settings.enrichment.model_copy(update={"overload": overload})
        settings = settings.model_copy(update={"enrichment": enrichment})
    if not via_prompts_topic:
        yield tag, settings
        return
    log = state_dir / f"enrich-{tag}.log" if enrich_process else None
    with prompts_stage(stack, settings, lambda _: None, process_log=log) as enriched:
        yield tag, enriched


def freshness(
    stack: StackState,
    state_dir: Path,
    spec: str,
    rate: float,
    seconds: float,
    *,
    enrich_process: bool = False,
    poll_s: float = 0.05,
) -> tuple[list[object], str]:
    """Every event a prompt at ``rate`` for ``seconds``: the time each signal took beyond the model call,
    at the variant's defaults (``variant_job``). ``poll_s``: how often every shopper's signal is read (a
    write carries its own time, so this only has to be shorter than a shopper's time between events,
    about 4 s)."""
    with variant_job(stack, state_dir, spec, enrich_process=enrich_process) as (tag, settings):
        return _freshness(stack, state_dir, spec, settings, tag, rate, seconds, poll_s)


def ceiling(stack: StackState, state_dir: Path, spec: str, events: int) -> tuple[float, str]:
    """What the variant moves saturated, every event a prompt: ``events`` add-to-carts, one per shopper
    (so latest wins supersedes none), all in the topic before the job starts; prompts landed per second
    between the 10th and the 90th percentile of the signals' Redis writes (start-up and tail left out).
    Nothing is dropped as stale here (``variant_job(saturated=True)``); the prompts topic's runner runs as
    a process of its own."""
    with variant_job(stack, state_dir, spec, enrich_process=True, saturated=True) as (tag, settings):
        producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 5})
        now = time.time()
        for n in range(events):
            shopper = f"shopper-{n:06d}"
            producer.produce(
                settings.kafka.events_topic,
                key=shopper.encode(),
                value=cart_event(tag, n, shopper, now),
                timestamp=int(now * 1000),
            )
            producer.poll(0)
        producer.flush(30)
        cluster = cluster_up(state_dir)
        rest = FlinkRest(cluster.web_url)
        job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
        with SignalPoller(stack.redis_url, settings.sinks.redis_key_prefix, interval_s=0.5) as poller:
            rest.wait_running(job.job_id)
            landed, quiet_since = 0, time.monotonic()
            while len(poller.seen) < events and time.monotonic() - quiet_since < 60:
                time.sleep(1)
                if len(poller.seen) > landed:
                    landed, quiet_since = len(poller.seen), time.monotonic()
        rest.cancel(job.job_id)
    writes = sorted(written for written, _ in poller.seen.values())
    if len(writes) < events * 0.9:
        raise RuntimeError(f"{spec}: only {len(writes)} of {events} signals landed")
    first, last = writes[len(writes) // 10], writes[len(writes) * 9 // 10]
    return (len(writes) * 0.8) / (last - first), describe(settings)


def near_ceiling(
    stack: StackState,
    state_dir: Path,
    spec: str,
    events: int,
    loads: list[float],
    seconds: float,
    reference: float | None,
) -> tuple[float, list[list[object]], str]:
    """The variant's own ceiling (``ceiling``), then freshness paced at each of ``loads`` x ``reference``
    prompts/s (the first variant's ceiling, so that every variant meets the same rates), or x its own
    ceiling where ``reference`` is None: its ceiling, and one row per load with the share of the
    offered prompts (after the warm-up) whose signal landed (the rest were superseded by the shopper's
    next prompt, or dropped as stale)."""
    top, described = ceiling(stack, state_dir, spec, events)
    print(f"{spec}: ceiling {top:.0f} prompts/s; {load_average()}", flush=True)
    rows: list[list[object]] = []
    for load in loads:
        rate = load * (reference or top)
        row, _ = freshness(stack, state_dir, spec, rate, seconds, enrich_process=True, poll_s=0.5)
        offered = rate * (seconds - WARMUP_S)
        measured = row[2]
        landed = f"{float(measured) / offered:.2f}" if isinstance(measured, int) else "-"
        rows.append([spec, f"{top:.0f}", f"{load:g}", f"{rate:.0f}", landed, *row[8:12]])
        print(f"  {rows[-1]}; {load_average()}", flush=True)
    return top, rows, described


def _freshness(
    stack: StackState,
    state_dir: Path,
    spec: str,
    settings: NearRealtimeSettings,
    tag: str,
    rate: float,
    seconds: float,
    poll_s: float,
) -> tuple[list[object], str]:
    topic = settings.kafka.events_topic
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
    try:
        rest.wait_running(job.job_id)
    except (TimeoutError, RuntimeError) as exc:
        rest.cancel(job.job_id)
        return [spec, "failed to start", str(exc)[:60], *["-"] * 9], describe(settings)
    shoppers = max(1, int(rate * 4))  # each shopper acts every ~4 s
    taskmanagers = [p.pid for p in cluster.processes if p.name.startswith("flink-taskmanager")]
    cpu_before = sum(process_group_cpu_seconds(pid) for pid in taskmanagers)
    machine_before = machine_busy_seconds()
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    with SignalPoller(stack.redis_url, settings.sinks.redis_key_prefix, interval_s=poll_s) as poller:
        started = time.time()
        for n in paced(rate, seconds):
            shopper = f"shopper-{n % shoppers:04d}"
            now = time.time()
            value = cart_event(tag, n, shopper, now)
            producer.produce(topic, key=shopper.encode(), value=value, timestamp=int(now * 1000))
            producer.poll(0)
        producer.flush(10)
        time.sleep(10)
    wall = time.time() - started
    cores_busy = (sum(process_group_cpu_seconds(pid) for pid in taskmanagers) - cpu_before) / wall
    machine_busy = (machine_busy_seconds() - machine_before) / wall
    rest.cancel(job.job_id)
    _, records = list_s3_records(settings.sinks, settings.sinks.s3_prefix)
    calls = {
        str(r["request_id"]): (float(r.get("produced_at") or 0), float(r.get("latency_ms") or 0) / 1000)
        for r in records
    }
    added, to_call, write = [], [], []
    for rid, (written, event_ts) in poller.seen.items():
        if event_ts - started <= WARMUP_S or rid not in calls:
            continue
        done, llm_s = calls[rid]
        added.append((written - event_ts - llm_s) * 1000)
        to_call.append((done - llm_s - event_ts) * 1000)
        write.append((written - done) * 1000)
    llm = [calls[rid][1] * 1000 for rid in poller.seen if rid in calls]
    row: list[object] = [
        spec,
        n,
        len(added),
        f"{percentile(llm, 0.5):.0f}",
        f"{percentile(to_call, 0.5):.0f}",
        f"{percentile(to_call, 0.99):.0f}",
        f"{percentile(write, 0.5):.0f}",
        f"{percentile(write, 0.99):.0f}",
        f"{percentile(added, 0.5):.0f}",
        f"{percentile(added, 0.99):.0f}",
        f"{cores_busy:.2f}",
        f"{machine_busy:.2f}",
    ]
    return row, describe(settings)


def throughput(
    stack: StackState, state_dir: Path, backlog: int, parallelisms: list[int]
) -> list[list[object]]:
    """The same backlog through the job at each parallelism (fresh topics and group each time), then
    through one embedded runner process; events/s and how many of the machine's cores the run kept busy."""
    rows: list[list[object]] = []
    records = SyntheticStream(shoppers=100, seed=3).take(backlog)
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    topic = ""
    for parallelism in parallelisms:
        tag = uuid.uuid4().hex[:8]
        # as before the defaults moved: a 3 s checkpoint bounds the slack in Flink's time
        knobs: Knobs = {"checkpoint_ms": 3_000, "capacity": 256}
        settings = bench_job(stack, state_dir, tag, knobs, live=False)
        settings = settings.model_copy(update={"parallelism": parallelism})
        topic = settings.kafka.events_topic
        ends = _produce(stack, topic, records)
        job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
        rest.wait_running(job.job_id)
        started, busy_before = time.monotonic(), machine_busy_seconds()
        wait_committed(stack.kafka_bootstrap, settings.kafka.group_id, topic, ends, timeout_s=600)
        flink_s = time.monotonic() - started
        busy = (machine_busy_seconds() - busy_before) / flink_s
        rest.cancel(job.job_id)
        rows.append(
            [f"Flink cluster (flink run, p={parallelism})", backlog, f"{flink_s:.1f}",
             f"{backlog / flink_s:.0f}", f"{busy:.2f}", ""]
        )  # fmt: skip
    tag = uuid.uuid4().hex[:8]
    runner = RunnerSettings(
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=f"bench-runner-{tag}",
        topic=topic,
        dlq_topic=f"bench-dlq-{tag}",
        until_drained=True,
        llm=stack.replica_client(),
        sinks=sink_settings(
            stack,
            redis_key_prefix=f"bench-runner-{tag}:",
            s3_prefix=f"bench-runner-{tag}",
            enabled=("redis", "s3"),
        ),
    )
    started, busy_before = time.monotonic(), machine_busy_seconds()
    stats = asyncio.run(EmbeddedRunner(runner, log=lambda _: None).run())
    runner_s = time.monotonic() - started
    busy = (machine_busy_seconds() - busy_before) / runner_s
    rows.append(
        ["embedded runner (1 process)", backlog, f"{runner_s:.1f}", f"{backlog / runner_s:.0f}",
         f"{busy:.2f}", stats.accounting.prompts]
    )  # fmt: skip
    return rows


def _produce(stack: StackState, topic: str, records: list[tuple[bytes, bytes, bool]]) -> dict[int, int]:
    ends: dict[int, int] = {}

    def delivered(error: object, message: object) -> None:
        partition, offset = message.partition(), message.offset()  # type: ignore[attr-defined]
        ends[partition] = max(ends.get(partition, 0), offset + 1)

    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 5})
    for key, value, _ in records:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
    producer.flush(30)
    return ends


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="events/s, each one a prompt")
    parser.add_argument("--seconds", type=float, default=45.0, help="freshness stream length; 0 = skip it")
    parser.add_argument(
        "--variants", default="default", help="';'-separated knob sets (see KNOBS), 'default' = none"
    )
    parser.add_argument("--bundles", help="shorthand: ','-separated bundle_time_ms variants")
    parser.add_argument("--backlog", type=int, default=0, help="throughput comparison; 0 = skip")
    parser.add_argument("--parallelism", default="1", help="throughput: ','-separated job parallelisms")
    parser.add_argument(
        "--loads",
        help="','-separated fractions of the first variant's ceiling (each variant's is measured first, "
        "on --ceiling-events) to pace the freshness stream at, e.g. 0.5,0.7,0.9; replaces the --rate run",
    )
    parser.add_argument("--ceiling-events", type=int, default=6000, help="the saturated run's events")
    parser.add_argument(
        "--own-ceiling",
        action="store_true",
        help="--loads of each variant's own ceiling, instead of the first variant's (the same rates for all)",
    )
    parser.add_argument("--out", default="flink_cluster.json", help="results file name under bench/results")
    args = parser.parse_args()
    variants = (
        [f"bundle_time_ms={b}" for b in args.bundles.split(",")] if args.bundles else args.variants.split(";")
    )
    state_dir = Path(tempfile.mkdtemp(prefix="bench-flink-"))
    stack = stack_up(StackSettings(state_dir=state_dir, replicas=2, time_scale=0.01))
    cluster = FlinkClusterSettings()
    try:
        print(
            f"machine: {machine()}; {load_average()}; Flink 2.3 standalone (1 JM, {cluster.taskmanagers} "
            f"TM x {cluster.task_slots} slot, heartbeat "
            f"{cluster.heartbeat_interval_ms} ms / timeout {cluster.heartbeat_timeout_ms} ms), Tansu, "
            "2 simulator replicas (x0.01)",
            flush=True,
        )
        rows: list[list[object]] = []
        loads = [load_average()]
        described = {}
        near: list[list[object]] = []
        reference: float | None = None
        for spec in variants if args.loads else []:
            top, variant_rows, described[spec] = near_ceiling(
                stack, state_dir, spec, args.ceiling_events, [float(x) for x in args.loads.split(",")],
                args.seconds, None if args.own_ceiling else reference,
            )  # fmt: skip
            reference = reference or top
            near += variant_rows
            loads.append(load_average())
        for spec in variants if args.seconds > 0 and not args.loads else []:
            row, settings = freshness(stack, state_dir, spec, args.rate, args.seconds)
            rows.append(row)
            described[spec] = settings
            loads.append(load_average())
            print(f"{spec}: {settings}; {loads[-1]}\n  {row}", flush=True)
        tables = []
        if near:
            tables.append(
                f"Near the ceiling ({args.ceiling_events:,} prompts saturated, then paced for "
                f"{args.seconds:g} s at each load of "
                + ("each variant's own ceiling" if args.own_ceiling else "the first variant's ceiling")
                + f", first {WARMUP_S:g} s excluded; the prompts topic's runner a process of its own):"
            )
            tables.append(
                print_table(
                    ["variant", "ceiling prompts/s", "load", "offered prompts/s", "landed ÷ offered",
                     "added p50 ms", "added p99 ms", "TM cores busy", "machine cores busy"],
                    near,
                )
            )  # fmt: skip
        if rows:
            tables.append(
                f"Freshness at {args.rate:g} events/s for {args.seconds:g} s, first {WARMUP_S:g} s excluded:"
            )
            tables.append(
                print_table(
                    [
                        "variant",
                        "events",
                        "measured",
                        "LLM p50 ms",
                        "to call p50",
                        "to call p99",
                        "write p50",
                        "write p99",
                        "added p50 ms",
                        "added p99 ms",
                        "TM cores busy",
                        "machine cores busy",
                    ],
                    rows,
                )
            )
        if args.backlog:
            tables.append(f"Throughput on a backlog of {args.backlog:,} synthetic events (100 shoppers):")
            tables.append(
                print_table(
                    ["engine", "events", "seconds", "events/s", "machine cores busy", "prompts"],
                    throughput(stack, state_dir, args.backlog, [int(p) for p in args.parallelism.split(",")]),
                )
            )
            loads.append(load_average())
        print(loads[-1])
        write_results(
            args.out,
            {
                "args": vars(args),
                "variants": described,
                "load_averages": loads,
                "table": "\n\n".join(tables),
            },
        )
    finally:
        cluster_down(state_dir)
        stack_down(state_dir)


if __name__ == "__main__":
    main()
