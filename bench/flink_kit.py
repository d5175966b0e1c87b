"""What the Flink cluster benchmarks share: the job's knobs (variants), its topics and settings, the
events they produce, a Redis signal poller and the wait for committed offsets. ``bench.flink_cluster``
(freshness, throughput) and ``bench.flink_recovery`` (a lost TaskManager) both import it, so neither
imports the other."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import redis as sync_redis
from confluent_kafka import Consumer, TopicPartition

from bench.common import create_topics
from bench.fleet import wait_replicas_idle
from devstack.enrichment_stage import enrichment_settings
from devstack.flink_cluster import (
    job_settings,
)
from devstack.runner_thread import RunnerThread
from devstack.stack import StackState, sink_settings, write_private
from flink_jobs.flink_config import CheckpointSettings, KafkaSettings, NearRealtimeSettings
from pipeline.topic_ends import end_offset
from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy

WARMUP_S = 15.0
REPO = Path(__file__).resolve().parents[1]

KNOBS: dict[str, tuple[str | None, str]] = {
    "bundle_time_ms": ("async_io", "bundle_time_ms"),
    "bundle_size": ("async_io", "bundle_size"),
    "capacity": ("async_io", "capacity"),
    "fetch_max_wait_ms": ("kafka", "fetch_max_wait_ms"),
    "buffer_timeout_ms": (None, "buffer_timeout_ms"),
    "checkpoint_ms": ("checkpoint", "interval_ms"),
    "session_stage_mode": (None, "session_stage_mode"),
    "parallelism": (None, "parallelism"),
    "prompts_topic": (None, "prompts_topic"),
}
"""Variant keys -> (settings section, field) of ``NearRealtimeSettings``. ``prompts_topic=on`` is read by
``bench.flink_cluster.variant_job``, which runs the job with a prompts topic of its own
(``prompts_stage``). The variant ``default`` is the job's own async stage (``bench_job``), as the results
files name it: it was the job's default until the prompts topic became it, and ``prompts_topic=on`` is
the job's default now (``docs/flink.md``, "Prompts topic")."""


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
        f"session stage in {settings.session_stage_mode} mode, parallelism {settings.parallelism}"
        + (", enriched by a runner from a prompts topic" if settings.prompts_topic else "")
    )


def make_topics(stack: StackState, tag: str) -> tuple[str, str, str]:
    names = (f"bench-ev-{tag}", f"bench-dlq-{tag}", f"bench-ins-{tag}")
    create_topics(stack.kafka_bootstrap, names)
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
            group_id=f"bench-{tag}",
            transactional_id_prefix=f"bench-{tag}",
        ),
        checkpoint=CheckpointSettings(directory=(state_dir / "flink" / "checkpoints").resolve().as_uri()),
        llm=stack.replica_client(),
        session=SessionConfig(triggers=TriggerPolicy(min_prompt_interval_s=0.0)) if live else SessionConfig(),
        sinks=sink_settings(
            stack, redis_key_prefix=prefix, s3_prefix=prefix.rstrip(":"), insights_topic=insights
        ),
        wall_clock_timers=live,
        flush_on_drain=not live,
        prompts_topic=None,  # the job's own async stage; prompts_stage hands it a prompts topic
    )
    return apply_variant(settings, knobs)


def with_live_defaults(settings: NearRealtimeSettings) -> NearRealtimeSettings:
    """``settings`` with the job's own defaults for a live stream (wall-clock timers on, nothing fired at
    a drain), where ``bench_job(live=False)`` makes prompts depend on event order alone."""
    fields = NearRealtimeSettings.model_fields
    live = {name: fields[name].default for name in ("wall_clock_timers", "flush_on_drain")}
    return settings.model_copy(update=live)


@contextmanager
def prompts_stage(
    stack: StackState,
    settings: NearRealtimeSettings,
    log: Callable[[str], None],
    *,
    process_log: Path | None = None,
) -> Iterator[NearRealtimeSettings]:
    """The job's enrichment as a stage of its own, as the job runs by default: a prompts topic of this
    run's (as many partitions as the event topic), and a runner with input 'prompts' on it with the
    settings ``devstack.enrichment_stage`` derives from the job's, until the block ends; yields the
    job's settings with ``prompts_topic`` set. The runner runs in a thread of this process, or, with
    ``process_log``, as a process of its own (``python -m devstack.enrichment_stage``, as ``shopper
    flink submit`` starts it; its log there). Either way it then stops as a SIGTERM stops it: in-flight
    prompts finish, one last durable point and commit."""
    topic = f"{settings.kafka.events_topic}-prompts"
    create_topics(stack.kafka_bootstrap, [topic])
    job = settings.model_copy(update={"prompts_topic": topic})
    if process_log is None:
        enrich = RunnerThread(enrichment_settings(job, progress_interval_s=10), log=log).start()
        try:
            yield job
        finally:
            enrich.stop()
        return
    config = process_log.with_suffix(".job.json")
    write_private(config, job.to_json())
    with process_log.open("ab") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "devstack.enrichment_stage", str(config)], stderr=stderr, cwd=REPO
        )
        try:
            yield job
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(240)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
            if child.returncode != 0:
                raise RuntimeError(f"the prompts runner exited {child.returncode}; see {process_log}")


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


def topic_end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition's high watermark: where a group that has read everything has committed to."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ends-{uuid.uuid4().hex[:8]}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: end_offset(consumer, TopicPartition(topic, p), timeout_s=10) for p in partitions}
    finally:
        consumer.close()


def drained(
    stack: StackState, settings: NearRealtimeSettings, *, live: bool, timeout_s: float = 900
) -> dict[int, int]:
    """The end of a run of the job on a stream that is all in its topic: until the job's group has
    committed every record (a completed checkpoint covers them) and then the replicas are quiet. With
    ``live`` (wall-clock timers), quiet for longer than a browse pause and a rate limit together, so
    that the last shoppers' pending triggers have fired and been answered. Returns the end offsets."""
    topic = settings.kafka.events_topic
    ends = topic_end_offsets(stack.kafka_bootstrap, topic)
    wait_committed(stack.kafka_bootstrap, settings.kafka.group_id, topic, ends, timeout_s)
    triggers = settings.session.triggers
    quiet_s = triggers.quiet_period_s + triggers.min_prompt_interval_s + 5.0 if live else 3.0
    wait_replicas_idle(stack.llm_endpoints, quiet_s=quiet_s)
    return ends


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
