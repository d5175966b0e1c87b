"""The Flink job on the standalone cluster over Kafka (Tansu): freshness at a steady rate, per bundle
time, and throughput on a backlog against the embedded runner, in one run on one machine.

    .venv/bin/python -m bench.flink_cluster [--rate 10] [--seconds 60] [--bundles 1000,200] [--backlog 1500]

Freshness: every event is an ``add_to_cart`` stamped with the wall clock when it is produced (its
Kafka timestamp), the job's rate limit is off, so each event is a prompt at once. A poller reads every
shopper's Redis signal (``updated_at`` is written by the sink) often enough that no write is missed
(each shopper acts every ``shoppers / rate`` s). Added latency = Redis ``updated_at`` - the event's
time - the LLM call's own ``latency_ms`` (from the S3 record): what the engine adds. The first 15 s
are warm-up. Throughput: the same synthetic backlog through the Flink job (from running to the group's
committed offsets covering every record, so up to one checkpoint interval of slack) and through the
embedded runner (until drained).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
import redis as sync_redis
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.common import machine, percentile, print_table
from devstack.flink_cluster import FlinkRest, cluster_down, cluster_up, job_settings, submit
from devstack.stack import StackSettings, StackState, sink_settings, stack_down, stack_up
from devstack.synthetic import SyntheticStream
from flink_jobs.flink_config import AsyncSettings, CheckpointSettings, KafkaSettings
from llm_client.config import ClientConfig
from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records

WARMUP_S = 15.0


def _topics(stack: StackState, tag: str) -> tuple[str, str, str]:
    names = (f"bench-ev-{tag}", f"bench-dlq-{tag}", f"bench-ins-{tag}")
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    for future in admin.create_topics([NewTopic(n, 4, 1) for n in names]).values():
        future.result(timeout=10)
    return names


def _job(stack: StackState, state_dir: Path, tag: str, bundle_ms: int, *, live: bool) -> tuple[object, str]:
    events, dlq, insights = _topics(stack, tag)
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
        checkpoint=CheckpointSettings(
            interval_ms=3_000, directory=(state_dir / "flink" / "checkpoints").resolve().as_uri()
        ),
        async_io=AsyncSettings(capacity=256, bundle_time_ms=bundle_ms),
        llm=ClientConfig(endpoints=stack.llm_endpoints, model=stack.model),
        session=SessionConfig(triggers=TriggerPolicy(min_prompt_interval_s=0.0)) if live else SessionConfig(),
        sinks=sink_settings(stack, redis_key_prefix=prefix, s3_prefix=prefix.rstrip(":")),
        wall_clock_timers=live,
        flush_on_drain=not live,
    )
    return settings, events


def freshness(
    stack: StackState, state_dir: Path, bundle_ms: int, rate: float, seconds: float
) -> list[object]:
    tag = uuid.uuid4().hex[:8]
    settings, topic = _job(stack, state_dir, tag, bundle_ms, live=True)
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")  # type: ignore[arg-type]
    rest.wait_running(job.job_id)
    prefix = settings.sinks.redis_key_prefix  # type: ignore[attr-defined]
    shoppers = max(1, int(rate * 4))  # each shopper acts every ~4 s
    seen: dict[str, tuple[float, float]] = {}
    stop = threading.Event()

    def poll() -> None:
        client = sync_redis.Redis.from_url(stack.redis_url, decode_responses=True)
        while not stop.wait(0.05):
            for key in client.scan_iter(match=f"{prefix}signals:*", count=1000):
                fields = client.hmget(key, ["request_id", "updated_at", "last_event_ts"])
                if fields[0] and fields[0] not in seen:
                    seen[fields[0]] = (float(fields[1] or 0), float(fields[2] or 0))
        client.close()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    started = time.time()
    n = 0
    while time.time() - started < seconds:
        due = started + n / rate
        time.sleep(max(0.0, due - time.time()))
        shopper = f"shopper-{n % shoppers:04d}"
        now = time.time()
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
        producer.produce(topic, key=shopper.encode(), value=orjson.dumps(event), timestamp=int(now * 1000))
        producer.poll(0)
        n += 1
    producer.flush(10)
    time.sleep(10)
    stop.set()
    poller.join(5)
    rest.cancel(job.job_id)
    sinks = settings.sinks  # type: ignore[attr-defined]
    _, records = list_s3_records(sinks, sinks.s3_prefix)
    llm_s = {str(r["request_id"]): float(r.get("latency_ms") or 0) / 1000 for r in records}
    added = [
        (written - event_ts - llm_s.get(rid, 0.0)) * 1000
        for rid, (written, event_ts) in seen.items()
        if event_ts - started > WARMUP_S and rid in llm_s
    ]
    llm = [llm_s[rid] * 1000 for rid in seen if rid in llm_s]
    return [
        bundle_ms,
        f"{rate:g}",
        n,
        len(added),
        f"{percentile(llm, 0.5):.0f}",
        f"{percentile(added, 0.5):.0f}",
        f"{percentile(added, 0.99):.0f}",
    ]


def throughput(stack: StackState, state_dir: Path, backlog: int) -> list[list[object]]:
    tag = uuid.uuid4().hex[:8]
    settings, topic = _job(stack, state_dir, tag, 1000, live=False)
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
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")  # type: ignore[arg-type]
    rest.wait_running(job.job_id)
    started = time.monotonic()
    group = settings.kafka.group_id  # type: ignore[attr-defined]
    consumer = Consumer({"bootstrap.servers": stack.kafka_bootstrap, "group.id": group})
    while True:
        done = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=10)
        if all(tp.offset >= ends[tp.partition] for tp in done):
            break
        time.sleep(0.5)
    flink_s = time.monotonic() - started
    consumer.close()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="events/s, each one a prompt")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--bundles", default="1000,200", help="python.fn-execution.bundle.time values, ms")
    parser.add_argument("--backlog", type=int, default=1500, help="0 = skip the throughput comparison")
    args = parser.parse_args()
    state_dir = Path(tempfile.mkdtemp(prefix="bench-flink-"))
    stack = stack_up(StackSettings(state_dir=state_dir, replicas=2, time_scale=0.01))
    try:
        print(f"machine: {machine()}; Flink 2.3 standalone (1 JM, 1 TM), Tansu, 2 simulator replicas (x0.01)")
        rows = [freshness(stack, state_dir, int(b), args.rate, args.seconds) for b in args.bundles.split(",")]
        print_table(
            ["bundle ms", "rate/s", "events", "measured", "LLM p50 ms", "added p50 ms", "added p99 ms"], rows
        )
        if args.backlog:
            print_table(
                ["engine", "events", "seconds", "events/s", "prompts"],
                throughput(stack, state_dir, args.backlog),
            )
    finally:
        cluster_down(state_dir)
        stack_down(state_dir)


if __name__ == "__main__":
    main()
