"""``make demo``: the whole pipeline on the embedded stack, end to end, then a report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from devstack.stack import (
    StackSettings,
    clear_stack_keys,
    describe_redis,
    load_state,
    sink_settings,
    stack_down,
    stack_up,
    state_file,
)
from llm_client.config import ClientConfig
from pipeline.kafka_security import configuration_error
from pipeline.redaction import mask_url
from pipeline.topics import DLQ_TOPIC, EVENTS_TOPIC
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from shopper.producer import produce
from shopper.readback import cell, describe_dead_letter, list_s3_records, read_dlq_values, read_signals


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
    state = stack_up(StackSettings(state_dir=state_dir, replicas=3, time_scale=0.05))
    # A stack the user had up already is theirs: the demo uses it and leaves it (and its keys) as it was.
    reused = before is not None and [p.pid for p in before.processes] == [p.pid for p in state.processes]
    console.print(f"kafka {state.kafka_bootstrap}  s3 {mask_url(state.s3_endpoint_url or '-')}")
    console.print(describe_redis(state), markup=False)
    console.print(f"LLM replicas ({state.model}): {', '.join(map(mask_url, state.llm_endpoints))}")
    if state.gateway_url:
        console.print(f"the runner calls them through the gateway at {mask_url(state.gateway_url)}")
    try:
        # Under the stack's own prefix, so 'stack down' deletes the demo's keys from a shared Redis.
        prefix = f"{state.redis_key_prefix}demo-{int(time.time())}:"
        s3_prefix = prefix.rstrip(":").replace(":", "-")
        console.rule("2. produce")
        report = produce(
            state.kafka_bootstrap,
            EVENTS_TOPIC,
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
                malformed=report.malformed,
                console=console,
                security=security,
            )
        console.rule("3. run until drained")
        try:
            settings = RunnerSettings(
                bootstrap_servers=state.kafka_bootstrap,
                group_id=f"demo-{prefix}",
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
        dlq = read_dlq_values(state.kafka_bootstrap, DLQ_TOPIC, security=security)
        example = describe_dead_letter(dlq[0])[0] if dlq else "-"
        console.print(f"DLQ {DLQ_TOPIC}: {len(dlq)} records; e.g. '{example}'", markup=False)
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
        ok = acct.balanced and len(dlq) == report.malformed and len(records) >= acct.prompts
        console.print("[green]all accounted for[/green]" if ok else "[red]ACCOUNTING MISMATCH[/red]")
        redis.Redis.from_url(state.redis_url).close()
        return 0 if ok else 1
    finally:
        if reused:
            console.print(
                f"the stack in {state_dir} was up before the demo: left running, with the demo's keys "
                f"under {state.redis_key_prefix!r}"
            )
        elif not keep_stack:
            console.rule("5. stack down")
            if state_file(state_dir).exists() and (shown := load_state(state_dir)).redis_shared:
                deleted = clear_stack_keys(shown)
                console.print(f"deleted {deleted} keys ({shown.redis_key_prefix}*) from the shared Redis")
            console.print(f"stopped: {', '.join(stack_down(state_dir, clear_keys=False))}")
        elif state.redis_shared:
            console.print(
                f"the demo's keys stay in the shared Redis under {state.redis_key_prefix!r} until "
                "'shopper stack down' (or their TTL)"
            )
