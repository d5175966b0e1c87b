"""Embedded runner benchmark: ingest events/s and freshness (produce -> Redis) on the embedded stack.

Scenarios (one run, same machine, same stack):
- ingest: triggers limited to one prompt per shopper (a per-shopper rate limit of a day), so the LLM
  is not the bottleneck: measures Kafka consume + parse + sessions + Redis state + commits;
- llm@0: every trigger calls the simulator at time scale 0 (LLM answers instantly, HTTP still real);
- llm@H100: the simulator at time scale 1 (H100 32B timings), events produced at a fixed rate with
  wall-clock timestamps, freshness = Redis write time - Kafka timestamp of the triggering event.

    python bench/runner.py [--events 60000] [--shoppers 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from pathlib import Path

from bench.common import machine, percentile, print_table, temporary_stack
from devstack.stack import StackState, sink_settings
from llm_client.config import ClientConfig
from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.progress import RunnerStats
from shopper.producer import produce

RESULTS = Path(__file__).parent / "results"


def settings_for(
    state: StackState, topic: str, session: SessionConfig, until_drained: bool = True
) -> RunnerSettings:
    tag = uuid.uuid4().hex[:8]
    return RunnerSettings(
        bootstrap_servers=state.kafka_bootstrap,
        group_id=f"bench-{tag}",
        topic=topic,
        until_drained=until_drained,
        progress_interval_s=10,
        session=session,
        llm=ClientConfig(endpoints=state.llm_endpoints, model=state.model, max_in_flight=256),
        sinks=sink_settings(state, redis_key_prefix=f"bench-{tag}:", s3_prefix=f"bench-{tag}"),
    )


def create_topic(bootstrap: str, partitions: int = 4) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(10)
    return name


def run_drained(settings: RunnerSettings) -> tuple[RunnerStats, float]:
    started = time.perf_counter()
    stats = asyncio.run(EmbeddedRunner(settings, log=lambda _: None).run())
    return stats, time.perf_counter() - started - settings.drain_idle_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--shoppers", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=40.0, help="events/s for the freshness run")
    parser.add_argument("--freshness-events", type=int, default=2400)
    args = parser.parse_args()
    rows = []
    print(f"machine: {machine()}")
    with temporary_stack(replicas=3, time_scale=0.0) as state:
        topic = create_topic(state.kafka_bootstrap)
        produce(
            state.kafka_bootstrap,
            topic,
            events=args.events,
            shoppers=args.shoppers,
            rate=None,
            malformed_rate=0.005,
            seed=1,
        )
        # No trigger fires while events stream in (nothing prompts at once, browsing waits a day), so
        # the window measures ingest alone; every shopper's one prompt fires at the final drain.
        one_prompt = SessionConfig(
            triggers=TriggerPolicy(min_prompt_interval_s=86_400, quiet_period_s=86_400, immediate_types=())
        )
        stats, seconds = run_drained(settings_for(state, topic, one_prompt))
        rows.append(
            [
                "ingest only (prompts at drain)",
                args.events,
                stats.accounting.prompts,
                seconds,
                stats.ingest_rate,
                args.events / seconds,
                "-",
                "-",
            ]
        )
        stats, seconds = run_drained(settings_for(state, topic, SessionConfig()))
        rows.append(
            [
                "every trigger, LLM@0",
                args.events,
                stats.accounting.prompts,
                seconds,
                stats.ingest_rate,
                args.events / seconds,
                "-",
                f"{stats.cache_hit_ratio:.2f}",
            ]
        )
    with temporary_stack(replicas=3, time_scale=1.0) as state:
        topic = create_topic(state.kafka_bootstrap)
        settings = settings_for(state, topic, SessionConfig(), until_drained=False)
        settings.timer_wall_per_event_s = 1.0
        runner = EmbeddedRunner(settings, log=lambda _: None)
        producer = threading.Thread(
            target=produce,
            args=(state.kafka_bootstrap, topic),
            kwargs={
                "events": args.freshness_events,
                "shoppers": args.shoppers // 4,
                "rate": args.rate,
                "malformed_rate": 0.0,
                "seed": 2,
                "realtime_ts": True,
            },
        )

        async def timed() -> RunnerStats:
            task = asyncio.create_task(runner.run())
            await asyncio.sleep(2)
            producer.start()
            await asyncio.to_thread(producer.join)
            await asyncio.sleep(5)
            runner.request_stop()
            return await task

        started = time.perf_counter()
        stats = asyncio.run(timed())
        seconds = time.perf_counter() - started
        fresh = stats.freshness_ms
        rows.append(
            [
                f"paced {args.rate:.0f}/s, LLM@H100 32B",
                args.freshness_events,
                stats.accounting.prompts,
                seconds,
                stats.ingest_rate,
                stats.accounting.consumed / seconds,
                f"p50 {percentile(fresh, 0.5):.0f} / p99 {percentile(fresh, 0.99):.0f}",
                f"{stats.cache_hit_ratio:.2f}",
            ]
        )
    headers = [
        "scenario",
        "events",
        "prompts",
        "seconds",
        "ingest events/s",
        "end-to-end events/s",
        "freshness ms",
        "cache hit",
    ]
    table = print_table(headers, rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "runner.json").write_text(
        json.dumps({"machine": machine(), "rows": rows, "table": table}, indent=1)
    )


if __name__ == "__main__":
    main()
