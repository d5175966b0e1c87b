"""The Flink job on the standalone cluster over Kafka (Tansu): freshness at a steady rate per setting,
throughput on a backlog against the embedded runner, and recovery from a lost TaskManager, in one run
on one machine.

    .venv/bin/python -m bench.flink_cluster [--rate 10] [--seconds 45]
        [--variants "default;bundle_time_ms=200"] [--backlog 1500]
    .venv/bin/python -m bench.flink_cluster --recovery [--rate 10] [--seconds 120] [--kill-after 40]

Freshness: every event is an ``add_to_cart`` stamped with the wall clock when it is produced (its
Kafka timestamp), the job's rate limit is off, so each event is a prompt at once. A poller reads every
shopper's Redis signal (``updated_at`` is written by the sink) often enough that no write is missed
(each shopper acts every ``shoppers / rate`` s). Added latency = Redis ``updated_at`` - the event's
time - the LLM call's own ``latency_ms`` (from the S3 record): what the engine adds. It is split at the
LLM call: "to call" = the call's start (``produced_at - latency_ms``) - the event's time (Kafka fetch,
the keyed session stage's bundle, the exchange, the async stage's bundle), "write" = Redis
``updated_at`` - the call's end. The first 15 s are warm-up.

A variant is the job's defaults with some knobs changed (``KNOBS``), e.g. ``bundle_time_ms=200,
fetch_max_wait_ms=500``; ``default`` changes nothing. Throughput: the same synthetic backlog through
the Flink job (from running to the group's committed offsets covering every record, so up to one
checkpoint interval of slack) and through the embedded runner (until drained). Recovery:
``bench/flink_recovery.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
import redis as sync_redis
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.common import machine, paced, percentile, print_table
from devstack.flink_cluster import (
    FlinkClusterSettings,
    FlinkRest,
    cluster_down,
    cluster_up,
    job_settings,
    submit,
)
from devstack.stack import StackSettings, StackState, sink_settings, stack_down, stack_up
from devstack.synthetic import SyntheticStream
from flink_jobs.flink_config import CheckpointSettings, KafkaSettings, NearRealtimeSettings
from llm_client.config import ClientConfig
from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records

WARMUP_S = 15.0

KNOBS: dict[str, tuple[str | None, str]] = {
    "bundle_time_ms": ("async_io", "bundle_time_ms"),
    "bundle_size": ("async_io", "bundle_size"),
    "capacity": ("async_io", "capacity"),
    "fetch_max_wait_ms": ("kafka", "fetch_max_wait_ms"),
    "buffer_timeout_ms": (None, "buffer_timeout_ms"),
    "checkpoint_ms": ("checkpoint", "interval_ms"),
    "session_stage_mode": (None, "session_stage_mode"),
}
"""Variant keys -> (settings section, field) of ``NearRealtimeSettings``."""


Knobs = dict[str, int | str]


def parse_variant(spec: str) -> Knobs:
    """``"bundle_time_ms=200,session_stage_mode=thread"`` -> knobs; ``"default"`` -> none."""
    spec = spec.strip()
    if spec in {"", "default"}:
        return {}
    knobs: Knobs = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in KNOBS:
            raise SystemExit(f"unknown knob {name!r}; known: {', '.join(KNOBS)}")
        knobs[name.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return knobs


def apply_variant(settings: NearRealtimeSettings, knobs: Knobs) -> NearRealtimeSettings:
    for name, value in knobs.items():
        section, field = KNOBS[name]
        setattr(settings if section is None else getattr(settings, section), field, value)
    return settings


def describe(settings: NearRealtimeSettings) -> str:
    """The latency-relevant settings of a job, for the tables."""
    return (
        f"bundle {settings.async_io.bundle_time_ms} ms / {settings.async_io.bundle_size}, "
        f"fetch.max.wait {settings.kafka.fetch_max_wait_ms} ms, "
        f"buffer timeout {settings.buffer_timeout_ms} ms, "
        f"checkpoint every {settings.checkpoint.interval_ms} ms, capacity {settings.async_io.capacity}, "
        f"session stage in {settings.session_stage_mode} mode"
    )


def make_topics(stack: StackState, tag: str) -> tuple[str, str, str]:
    names = (f"bench-ev-{tag}", f"bench-dlq-{tag}", f"bench-ins-{tag}")
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    for future in admin.create_topics([NewTopic(n, 4, 1) for n in names]).values():
        future.result(timeout=10)
    return names


def bench_job(
    stack: StackState, state_dir: Path, tag: str, knobs: Knobs, *, live: bool
) -> NearRealtimeSettings:
    """The job's defaults (checkpoint interval, bundles, capacity, fetch wait) with this run's names and
    ``knobs``. ``live``: the rate limit off and wall-clock timers on (each ``add_to_cart`` is a prompt
    at once); otherwise prompts depend only on event order and the end is a drain."""
    events, dlq, insights = make_topics(stack, tag)
    prefix = f"bench-flink-{tag}:"
    settings = job_settings(
        stack,
        state_dir,
        kafka=KafkaSettings(
            bootstrap_servers=stack.kafka_bootstrap,
            events_topic=events,
            dlq_topic=dlq,
            insights_topic=insights,
            group_id=f"bench-{tag}",
            transactional_id_prefix=f"bench-{tag}",
        ),
        checkpoint=CheckpointSettings(directory=(state_dir / "flink" / "checkpoints").resolve().as_uri()),
        llm=ClientConfig(endpoints=stack.llm_endpoints, model=stack.model),
        session=SessionConfig(triggers=TriggerPolicy(min_prompt_interval_s=0.0)) if live else SessionConfig(),
        sinks=sink_settings(stack, redis_key_prefix=prefix, s3_prefix=prefix.rstrip(":")),
        wall_clock_timers=live,
        flush_on_drain=not live,
    )
    return apply_variant(settings, knobs)


def cart_event(tag: str, n: int, shopper: str, now: float) -> bytes:
    """An ``add_to_cart`` (a prompt at once with the rate limit off) stamped ``now``."""
    event = {
        "event_id": f"{tag}-{n}",
        "shopper_id": shopper,
        "type": "add_to_cart",
        "ts": now,
        "product": {
            "product_id": f"p{n % 50}",
            "title": "Trail shoe",
            "brand": "Acme",
            "category": "shoes",
            "price": 90.0,
        },
    }
    return orjson.dumps(event)


class SignalPoller:
    """Samples every shopper's Redis signal: ``request_id -> (updated_at, last_event_ts)`` of each
    version seen. Keys are re-listed every second and read in one pipeline per ``interval_s``."""

    def __init__(self, redis_url: str, prefix: str, interval_s: float = 0.05) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.interval_s = interval_s
        self.seen: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SignalPoller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        client = sync_redis.Redis.from_url(self.redis_url, decode_responses=True)
        keys: list[str] = []
        listed = 0.0
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - listed > 1.0:
                keys = list(client.scan_iter(match=f"{self.prefix}signals:*", count=1000))
                listed = time.monotonic()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, ["request_id", "updated_at", "last_event_ts"])
            for request_id, updated_at, event_ts in pipe.execute():
                if request_id and request_id not in self.seen:
                    self.seen[request_id] = (float(updated_at or 0), float(event_ts or 0))
        client.close()


def freshness(
    stack: StackState, state_dir: Path, spec: str, rate: float, seconds: float
) -> tuple[list[object], str]:
    tag = uuid.uuid4().hex[:8]
    settings = bench_job(stack, state_dir, tag, parse_variant(spec), live=True)
    topic = settings.kafka.events_topic
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
    try:
        rest.wait_running(job.job_id)
    except (TimeoutError, RuntimeError) as exc:
        rest.cancel(job.job_id)
        return [spec, "failed to start", str(exc)[:60], *["-"] * 7], describe(settings)
    shoppers = max(1, int(rate * 4))  # each shopper acts every ~4 s
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    with SignalPoller(stack.redis_url, settings.sinks.redis_key_prefix) as poller:
        started = time.time()
        for n in paced(rate, seconds):
            shopper = f"shopper-{n % shoppers:04d}"
            now = time.time()
            value = cart_event(tag, n, shopper, now)
            producer.produce(topic, key=shopper.encode(), value=value, timestamp=int(now * 1000))
            producer.poll(0)
        producer.flush(10)
        time.sleep(10)
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
    ]
    return row, describe(settings)


def throughput(stack: StackState, state_dir: Path, backlog: int) -> list[list[object]]:
    tag = uuid.uuid4().hex[:8]
    # as before the defaults moved: a 3 s checkpoint bounds the slack in Flink's time
    settings = bench_job(stack, state_dir, tag, {"checkpoint_ms": 3_000, "capacity": 256}, live=False)
    topic = settings.kafka.events_topic
    records = SyntheticStream(shoppers=100, seed=3).take(backlog)
    ends: dict[int, int] = {}

    def delivered(error: object, message: object) -> None:
        partition, offset = message.partition(), message.offset()  # type: ignore[attr-defined]
        ends[partition] = max(ends.get(partition, 0), offset + 1)

    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 5})
    for key, value, _ in records:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
    producer.flush(30)
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
    rest.wait_running(job.job_id)
    started = time.monotonic()
    wait_committed(stack.kafka_bootstrap, settings.kafka.group_id, topic, ends, timeout_s=600)
    flink_s = time.monotonic() - started
    rest.cancel(job.job_id)
    runner = RunnerSettings(
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=f"bench-runner-{tag}",
        topic=topic,
        dlq_topic=f"bench-dlq-{tag}",
        until_drained=True,
        llm=ClientConfig(endpoints=stack.llm_endpoints, model=stack.model),
        sinks=sink_settings(stack, redis_key_prefix=f"bench-runner-{tag}:", s3_prefix=f"bench-runner-{tag}"),
    )
    started = time.monotonic()
    stats = asyncio.run(EmbeddedRunner(runner, log=lambda _: None).run())
    runner_s = time.monotonic() - started
    return [
        ["Flink cluster (flink run, p=1)", backlog, f"{flink_s:.1f}", f"{backlog / flink_s:.0f}", ""],
        [
            "embedded runner",
            backlog,
            f"{runner_s:.1f}",
            f"{backlog / runner_s:.0f}",
            stats.accounting.prompts,
        ],
    ]


def wait_committed(bootstrap: str, group: str, topic: str, ends: dict[int, int], timeout_s: float) -> None:
    """Until the group's committed offsets cover ``ends`` (a completed checkpoint covers every record)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            done = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=10)
            if all(tp.offset >= ends[tp.partition] for tp in done):
                return
            time.sleep(0.5)
    finally:
        consumer.close()
    raise TimeoutError(f"group {group} did not commit {ends} within {timeout_s} s")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="events/s, each one a prompt")
    parser.add_argument("--seconds", type=float, default=None, help="stream length (45; 120 with --recovery)")
    parser.add_argument(
        "--variants", default="default", help="';'-separated knob sets (see KNOBS), 'default' = none"
    )
    parser.add_argument("--bundles", help="shorthand: ','-separated bundle_time_ms variants")
    parser.add_argument("--backlog", type=int, default=0, help="throughput comparison; 0 = skip")
    parser.add_argument("--recovery", action="store_true", help="SIGKILL the TaskManager mid-stream")
    parser.add_argument("--kill-after", type=float, default=40.0, help="recovery: seconds into the stream")
    args = parser.parse_args()
    variants = (
        [f"bundle_time_ms={b}" for b in args.bundles.split(",")] if args.bundles else args.variants.split(";")
    )
    state_dir = Path(tempfile.mkdtemp(prefix="bench-flink-"))
    stack = stack_up(StackSettings(state_dir=state_dir, replicas=2, time_scale=0.01))
    cluster = FlinkClusterSettings()
    try:
        print(
            f"machine: {machine()}; {load_average()}; Flink 2.3 standalone (1 JM, 1 TM, heartbeat "
            f"{cluster.heartbeat_interval_ms} ms / timeout {cluster.heartbeat_timeout_ms} ms), Tansu, "
            "2 simulator replicas (x0.01)",
            flush=True,
        )
        if args.recovery:
            from bench.flink_recovery import print_recovery, recovery

            print_recovery(
                recovery(
                    stack,
                    state_dir,
                    parse_variant(variants[0]),
                    rate=args.rate,
                    seconds=args.seconds or 120.0,
                    kill_after=args.kill_after,
                )
            )
            return
        rows: list[list[object]] = []
        for spec in variants:
            row, settings = freshness(stack, state_dir, spec, args.rate, args.seconds or 45.0)
            rows.append(row)
            print(f"{spec}: {settings}; {load_average()}\n  {row}", flush=True)
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
            ],
            rows,
        )
        if args.backlog:
            print_table(
                ["engine", "events", "seconds", "events/s", "prompts"],
                throughput(stack, state_dir, args.backlog),
            )
        print(load_average())
    finally:
        cluster_down(state_dir)
        stack_down(state_dir)


if __name__ == "__main__":
    main()
