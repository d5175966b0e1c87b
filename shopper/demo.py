"""``make demo``: the whole pipeline on the embedded stack, end to end, then a report."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from pydantic import ValidationError
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from devstack.processes import running
from devstack.stack import (
    StackSettings,
    StackState,
    clear_stack_keys,
    describe_redis,
    load_state,
    sink_settings,
    stack_down,
    stack_up,
    state_file,
)
from llm_client.config import ClientConfig
from pipeline.kafka_security import KafkaSecurity, configuration_error, librdkafka_properties
from pipeline.redaction import mask_url
from pipeline.topics import EVENTS_TOPIC, PROMPTS_TOPIC
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from shopper.producer import produce
from shopper.readback import cell, describe_dead_letter, list_s3_records, read_dlq_values, read_signals

DEMO_PARTITIONS = 4
"""Partitions of the demo's events topic: the stack's own (``StackSettings.partitions``)."""


@dataclass(frozen=True)
class DemoTopics:
    """Topics of one demo run only. The stack's ``shopper-events`` may hold earlier events (a stack
    that was up, a broker given with ``STACK_KAFKA_BOOTSTRAP``), which a new consumer group reads from
    the start: the demo paid the LLM for them again and counted their dead letters as its own."""

    events: str
    dlq: str
    prompts: str
    """The Flink job's hand-over to its enrichment runner (made by ``submit_with_enrichment``)."""

    @classmethod
    def named(cls, tag: str) -> DemoTopics:
        return cls(f"{EVENTS_TOPIC}-{tag}", f"{EVENTS_TOPIC}-{tag}-dlq", f"{PROMPTS_TOPIC}-{tag}")

    def create(self, bootstrap: str, security: KafkaSecurity) -> None:
        """Makes the events and dead-letter topics; raises if one exists: its records are not the demo's."""
        admin = AdminClient({"bootstrap.servers": bootstrap, **librdkafka_properties(security)})
        new = [NewTopic(self.events, DEMO_PARTITIONS, 1), NewTopic(self.dlq, 1, 1)]
        for future in admin.create_topics(new).values():
            future.result(timeout=30)


def run_demo(
    state_dir: Path,
    *,
    events: int,
    shoppers: int,
    keep_stack: bool,
    console: Console,
    engine: str = "embedded",
) -> int:
    from shopper.cli import kafka_security

    security = kafka_security()  # the runner's TLS/SASL, for every Kafka client of the demo
    console.rule("1. embedded stack")
    before = load_state(state_dir) if state_file(state_dir).exists() else None
    # A stack the user had up already is theirs, however it was started (replicas, P/D, llama): the
    # demo uses it and leaves it (and its keys) as it was. 'stack up' with the demo's settings refuses
    # a stack started with others.
    reused = before is not None and all(running(p) for p in before.processes)
    state = (
        before
        if reused and before is not None
        else stack_up(StackSettings(state_dir=state_dir, replicas=3, time_scale=0.05))
    )
    console.print(f"kafka {state.kafka_bootstrap}  s3 {mask_url(state.s3_endpoint_url or '-')}")
    console.print(describe_redis(state), markup=False)
    console.print(f"LLM replicas ({state.model}): {', '.join(map(mask_url, state.llm_endpoints))}")
    if state.gateway_url:
        console.print(f"the runner calls them through the gateway at {mask_url(state.gateway_url)}")
    try:
        tag = f"demo-{int(time.time())}"
        # Under the stack's own prefix, so 'stack down' deletes the demo's keys from a shared Redis.
        prefix = f"{state.redis_key_prefix}{tag}:"
        s3_prefix = prefix.rstrip(":").replace(":", "-")
        topics = DemoTopics.named(tag)
        topics.create(state.kafka_bootstrap, security)
        console.rule("2. produce")
        console.print(f"to {topics.events}, a topic of the demo's own (dead letters: {topics.dlq})")
        report = produce(
            state.kafka_bootstrap,
            topics.events,
            events=events,
            shoppers=shoppers,
            rate=None,
            malformed_rate=0.01,
            seed=7,
            security=security,
        )
        console.print(
            f"{report.sent} events ({report.malformed} deliberately malformed) in {report.seconds:.2f} s"
        )
        if engine == "flink":
            from shopper.flink_cli import run_flink_demo_step

            console.rule("3. flink run on a local standalone Flink cluster, then flink stop --drain")
            return run_flink_demo_step(
                state,
                state_dir,
                prefix=prefix,
                s3_prefix=s3_prefix,
                topics=topics,
                malformed=report.malformed,
                console=console,
                security=security,
            )
        console.rule("3. run until drained")
        try:
            settings = RunnerSettings(
                bootstrap_servers=state.kafka_bootstrap,
                group_id=f"demo-{prefix}",
                topic=topics.events,
                dlq_topic=topics.dlq,
                until_drained=True,
                llm=ClientConfig(endpoints=state.stream_endpoints, model=state.model),
                sinks=sink_settings(state, redis_key_prefix=prefix, s3_prefix=s3_prefix),
            )
        except ValidationError as error:
            raise configuration_error(error, "RUNNER_* settings") from None
        stats = asyncio.run(
            EmbeddedRunner(settings, log=lambda line: console.print(f"[dim]{line}[/dim]")).run()
        )
        console.rule("4. what landed")
        rows = asyncio.run(read_signals(state.redis_url, [], 8, prefix=prefix))
        table = Table(
            "shopper",
            "v",
            "understanding (from Redis)",
            "occasion",
            "price",
            "cached/prompt",
            title="Redis signals",
        )
        for row in rows:
            table.add_row(
                cell(row["shopper_id"]),
                cell(row["seq"]),
                cell(row["summary"]),
                cell(row["occasion"] or "-"),
                cell(row["price_sensitivity"]),
                cell(f"{row['cached_tokens']}/{row['prompt_tokens']}"),
            )
        console.print(table)
        if state.llm_kind == "sim":
            console.print(
                "[dim]Answers come from the TensorRT-LLM simulator: a rule-based stand-in that reads each "
                "prompt's activity log (top categories by intent, price band, an occasion from the cart), "
                "not a language model; 'shopper stack up --llm llama' serves a real one.[/dim]"
            )
        keys, records = list_s3_records(sink_settings(state), s3_prefix)
        console.print(
            f"S3: {len(keys)} objects, {len(records)} records in s3://{state.s3_bucket}/{s3_prefix}/, e.g."
        )
        for key in keys[:4]:
            console.print(f"  {key}")
        dlq = read_dlq_values(state.kafka_bootstrap, topics.dlq, security=security)
        example = describe_dead_letter(dlq[0])[0] if dlq else "-"
        console.print(f"DLQ {topics.dlq}: {len(dlq)} records; e.g. '{example}'", markup=False)
        acct = stats.accounting
        totals = Table(
            "events in",
            "in sessions",
            "duplicates",
            "dead-lettered",
            "unaccounted",
            "prompts",
            "insights",
            "errors",
            "superseded",
            "unaccounted",
            title="Accounting",
        )
        totals.add_row(
            *(
                str(v)
                for v in (
                    acct.consumed,
                    acct.accepted,
                    acct.duplicates,
                    acct.dead_lettered,
                    acct.events_unaccounted,
                    acct.prompts,
                    acct.insights,
                    acct.errors,
                    acct.superseded,
                    acct.prompts_unaccounted,
                )
            )
        )
        console.print(totals)
        reuse = stats.estimated_shared_tokens / max(1, stats.estimated_prompt_tokens)
        console.print(
            f"prompt prefix reuse (estimate, all prompts): {reuse:.2f}; "
            f"server-reported cache hits: {stats.cache_hit_ratio:.2f}"
        )
        every_event = acct.consumed - acct.rekeyed == report.sent and len(dlq) == report.malformed
        ok = acct.balanced and every_event and len(records) >= acct.prompts
        console.print("[green]all accounted for[/green]" if ok else "[red]ACCOUNTING MISMATCH[/red]")
        redis.Redis.from_url(state.redis_url).close()
        return 0 if ok else 1
    finally:
        if reused:
            console.print(
                f"the stack in {state_dir} was up before the demo: left running, with the demo's keys "
                f"under {state.redis_key_prefix!r} and its topics"
            )
        elif not keep_stack:
            console.rule("5. stack down")
            shown = load_state(state_dir) if state_file(state_dir).exists() else None
            console.print(f"stopped: {', '.join(stack_down(state_dir, clear_keys=False))}")
            if shown is not None and shown.redis_shared:
                clear_keys_or_warn(shown, console)
        elif state.redis_shared:
            console.print(
                f"the demo's keys stay in the shared Redis under {state.redis_key_prefix!r} until "
                "'shopper stack down' (or their TTL)"
            )


def clear_keys_or_warn(state: StackState, console: Console) -> None:
    """Deletes the stack's keys from the shared Redis once its processes are stopped. A Redis that does
    not answer (stopped, or asking for a password) costs only the keys, which expire with their TTL: its
    error used to leave the whole stack running, and its state file for the next demo to take as the
    user's stack."""
    try:
        deleted = clear_stack_keys(state)
    except RedisError as exc:
        console.print(
            f"left this stack's keys ({state.redis_key_prefix}*) in the shared Redis: it did not answer "
            f"({exc}); they expire with their TTL",
            style="yellow",
            markup=False,
        )
        return
    console.print(f"deleted {deleted} keys ({state.redis_key_prefix}*) from the shared Redis", markup=False)
