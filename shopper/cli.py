"""``shopper``: one command for the embedded stack and the pipeline. Addresses come from the stack's
state file unless given explicitly, so the same commands work against real Kafka/Redis/S3/LLMs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
from confluent_kafka import KafkaError, KafkaException
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from devstack.processes import interrupt
from devstack.stack import (
    StackSettings,
    clear_stack_keys,
    describe_redis,
    load_state,
    stack_down,
    stack_status,
    stack_up,
    state_file,
)
from pipeline.kafka_security import KafkaSecurity, configuration_error, settings_from_environment
from pipeline.redaction import RedactingStream, secrets_in_environment
from pipeline.topics import DLQ_TOPIC, EVENTS_TOPIC
from prompt_assembly.errors import ShopperError
from runner.config import RunnerSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)


@app.callback()
def _no_secret_in_output(ctx: typer.Context) -> None:
    # Runs before every command (a new one included): whatever it or a library prints on stdout or
    # stderr, a traceback too, goes through a RedactingStream that masks URL credentials and every
    # secret the environment holds (pipeline.redaction). Commands print redacted settings anyway;
    # this is the net for what they do not control (a sub-app's own print, an exception message).
    secrets = secrets_in_environment(os.environ)
    streams = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, RedactingStream):
            stream = RedactingStream(stream, secrets)
            setattr(sys, name, stream)
        streams.append(stream)

    def flush() -> None:
        for stream in streams:
            stream.flush()

    ctx.call_on_close(flush)


stack_app = typer.Typer(no_args_is_help=True, help="Start, stop and inspect the embedded stack.")
app.add_typer(stack_app, name="stack")
# Batch and real-time paths: sub-apps mounted from their packages.
from batch.cli import batch_app  # noqa: E402
from gateway.cli import router_app  # noqa: E402
from realtime.cli import realtime_app  # noqa: E402

app.add_typer(batch_app, name="batch")
app.add_typer(realtime_app, name="realtime")
app.add_typer(router_app, name="router")
from shopper.flink_cli import flink_app  # noqa: E402

app.add_typer(flink_app, name="flink")
console = Console(width=None if sys.stdout.isatty() else 150)
console_err = Console(stderr=True)


class Engine(StrEnum):
    embedded = "embedded"
    flink = "flink"


StateDir = Annotated[Path, typer.Option(help="where the stack keeps its state file and logs")]


@stack_app.command("up")
def stack_up_cmd(
    state_dir: StateDir = Path(".state"),
    llm: Annotated[str, typer.Option(help="sim (TensorRT-LLM simulator) or llama (Gemma 3 270M)")] = "sim",
    replicas: Annotated[int, typer.Option(help="LLM replicas")] = 3,
    time_scale: Annotated[float, typer.Option(help="simulator time scale; 1 = H100 32B timings")] = 0.05,
    partitions: int = 4,
    gateway: Annotated[
        bool | None,
        typer.Option(
            "--gateway/--no-gateway",
            help="the routing gateway in front of the replicas, which the stream jobs call "
            "[default: STACK_GATEWAY, else on]",
        ),
    ] = None,
) -> None:
    """Start what is not already reachable and write the addresses to the state file."""
    chosen: dict[str, object] = {} if gateway is None else {"gateway": gateway}
    try:
        settings = StackSettings.model_validate(
            {
                "state_dir": state_dir,
                "llm": llm,
                "replicas": replicas,
                "time_scale": time_scale,
                "partitions": partitions,
                **chosen,
            }
        )
    except ValidationError as error:
        raise configuration_error(error, "stack up's options (and STACK_*)") from None
    state = stack_up(settings)
    console.print_json(json.dumps(state.shown()))  # the state file keeps the secrets; this masks them
    console.print(describe_redis(state), markup=False)


@stack_app.command("down")
def stack_down_cmd(
    state_dir: StateDir = Path(".state"),
    keep_redis_keys: Annotated[
        bool, typer.Option(help="leave this stack's keys in a shared Redis (they expire with their TTL)")
    ] = False,
) -> None:
    """Stop exactly the processes 'stack up' started; delete the stack's keys from a shared Redis. The
    processes go first: a shared Redis that does not answer costs only the keys (they expire)."""
    state = load_state(state_dir) if state_file(state_dir).exists() else None
    stopped = stack_down(state_dir, clear_keys=False)
    console.print(f"stopped: {', '.join(stopped) or 'nothing'}")
    if state is None or not state.redis_shared:
        return
    if keep_redis_keys:
        console.print(f"kept this stack's keys ({state.redis_key_prefix}*) in the shared Redis")
        return
    try:
        deleted = clear_stack_keys(state)
    except RedisError as exc:
        console.print(
            f"[yellow]left this stack's keys ({state.redis_key_prefix}*) in the shared Redis: it did not "
            f"answer ({exc}); they expire with their TTL[/yellow]"
        )
        return
    console.print(f"deleted {deleted} keys under {state.redis_key_prefix!r} from the shared Redis")


@stack_app.command("status")
def stack_status_cmd(state_dir: StateDir = Path(".state")) -> None:
    console.print_json(json.dumps(stack_status(state_dir)))


@app.command()
def produce(
    events: Annotated[int, typer.Option(help="number of events")] = 10_000,
    shoppers: int = 200,
    rate: Annotated[float, typer.Option(help="events/s; 0 = as fast as possible")] = 0.0,
    malformed_rate: Annotated[float, typer.Option(help="share of deliberately broken messages")] = 0.005,
    seed: int = 7,
    realtime_ts: Annotated[bool, typer.Option(help="stamp events with the wall clock")] = False,
    bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap; default: the stack's")] = None,
    topic: str = EVENTS_TOPIC,
    state_dir: StateDir = Path(".state"),
) -> None:
    """Produce a synthetic shopper stream (seasonal catalog, Zipf-like shoppers, bursts and pauses).

    Kafka TLS/SASL: the runner's settings, RUNNER_KAFKA_SECURITY__*."""
    from shopper.producer import produce as run_produce

    security = kafka_security()
    bootstrap = bootstrap or load_state(state_dir).kafka_bootstrap
    report = run_produce(
        bootstrap,
        topic,
        events=events,
        shoppers=shoppers,
        rate=rate or None,
        malformed_rate=malformed_rate,
        seed=seed,
        realtime_ts=realtime_ts,
        security=security,
    )
    console.print(
        f"produced {report.sent} events ({report.malformed} malformed) to {topic} in {report.seconds:.2f} s "
        f"({report.sent / max(report.seconds, 1e-9):,.0f}/s)"
    )


def kafka_security() -> KafkaSecurity:
    """The runner's Kafka TLS/SASL settings (``RUNNER_KAFKA_SECURITY__*``): every command that talks
    to Kafka uses them, so one set of variables reaches every client."""
    return read_runner_settings().kafka_security


def read_runner_settings() -> RunnerSettings:
    """``RunnerSettings()`` from the environment; settings that cannot work raise ``ConfigurationError``
    (``InsecureConfiguration`` for a secret on a plaintext protocol) naming each one, never its value."""
    return settings_from_environment(RunnerSettings)


def runner_settings_from_stack(state_dir: Path, **overrides: Any) -> RunnerSettings:
    """The environment's settings (``RUNNER_*``) with the embedded stack's addresses on top.

    The stack replaces addresses only: every other sink setting the environment gives, under either
    name (``RUNNER_SINKS__REDIS_KEY_PREFIX`` or ``SINK_REDIS_KEY_PREFIX``), is kept, and the stack's
    own key prefix applies only where the environment sets none (``devstack.stack.sink_settings``)."""
    from devstack.stack import sink_settings

    state = load_state(state_dir)
    from_env = read_runner_settings()
    llm = from_env.llm.model_copy(update={"endpoints": state.stream_endpoints, "model": state.model})
    return from_env.model_copy(
        update={
            "bootstrap_servers": state.kafka_bootstrap,
            "llm": llm,
            "sinks": sink_settings(state, base=from_env.sinks),
            **overrides,
        }
    )


def runner_settings(
    *,
    from_stack: bool,
    state_dir: Path,
    until_drained: bool | None,
    group_id: str | None,
    policy: str | None,
) -> RunnerSettings:
    """What ``shopper run`` runs with: defaults < environment < stack addresses < options given.
    An option left out (``None``) never overrides the environment (``RUNNER_UNTIL_DRAINED``,
    ``RUNNER_GROUP_ID``, ``RUNNER_LLM__POLICY``)."""
    from runner.config import RunnerSettings

    overrides: dict[str, Any] = {}
    if until_drained is not None:
        overrides["until_drained"] = until_drained
    if group_id is not None:
        overrides["group_id"] = group_id
    settings = (
        runner_settings_from_stack(state_dir, **overrides)
        if from_stack
        else read_runner_settings().model_copy(update=overrides)
    )
    if policy is not None:
        settings = settings.model_copy(update={"llm": settings.llm.model_copy(update={"policy": policy})})
    try:
        return RunnerSettings.model_validate(settings.model_dump())
    except ValidationError as error:
        raise configuration_error(error, "RUNNER_* settings with the stack's addresses") from None


@app.command()
def run(
    until_drained: Annotated[
        bool | None,
        typer.Option(
            "--until-drained/--forever",
            help="exit once the topic is consumed and all results stored, or run until stopped "
            "[default: RUNNER_UNTIL_DRAINED or --forever]",
            show_default=False,
        ),
    ] = None,
    group_id: Annotated[
        str | None, typer.Option(help="consumer group [default: RUNNER_GROUP_ID or shopper-understanding]")
    ] = None,
    policy: Annotated[
        str | None, typer.Option(help="routing policy [default: RUNNER_LLM__POLICY or prefix_aware]")
    ] = None,
    from_stack: Annotated[bool, typer.Option(help="take addresses from the stack state file")] = True,
    state_dir: StateDir = Path(".state"),
    workers: Annotated[
        int, typer.Option(help="runner processes in the consumer group (one per core scales ingest)")
    ] = 1,
    report: Annotated[Path | None, typer.Option(help="write the accounting totals as JSON here")] = None,
) -> None:
    """Run the embedded pipeline (Kafka -> sessions -> LLM -> Redis + S3). Ctrl-C / SIGTERM drain."""
    from runner.embedded import EmbeddedRunner

    if workers > 1:
        from shopper.workers import run_workers

        passthrough = ["--state-dir", str(state_dir)]
        passthrough += ["--group-id", group_id] if group_id is not None else []
        passthrough += ["--policy", policy] if policy is not None else []
        passthrough += [] if until_drained is None else ["--until-drained" if until_drained else "--forever"]
        passthrough += [] if from_stack else ["--no-from-stack"]
        totals, failed = run_workers(workers, passthrough)
        console.print_json(json.dumps(totals.as_dict()))
        if report is not None:
            report.write_text(json.dumps(totals.as_dict()))
        if failed:
            console.print(f"[red]{failed} worker(s) failed[/red]")
            raise typer.Exit(1)
        drained = read_runner_settings().until_drained if until_drained is None else until_drained
        if drained and not totals.balanced:
            console.print("[red]unaccounted events or prompts[/red]")
            raise typer.Exit(1)
        return

    settings = runner_settings(
        from_stack=from_stack,
        state_dir=state_dir,
        until_drained=until_drained,
        group_id=group_id,
        policy=policy,
    )
    from pipeline.redaction import redacted_config_dump  # secrets and URL passwords masked

    console.print(f"runner config: {redacted_config_dump(settings, exclude={'session'})}", markup=False)
    from runner.errors import RunnerError

    try:
        stats = asyncio.run(EmbeddedRunner(settings).run())
    except RunnerError as exc:  # one line that says what to check, not a traceback
        console.print(f"runner stopped: {exc}", markup=False, style="red")
        raise typer.Exit(1) from None
    acct = stats.accounting
    console.print_json(json.dumps(acct.as_dict()))
    if report is not None:
        report.write_text(json.dumps(acct.as_dict()))
    if settings.until_drained and not acct.balanced:
        console.print("[red]unaccounted events or prompts[/red]")
        raise typer.Exit(1)


@app.command()
def signals(
    shopper_id: Annotated[
        list[str] | None, typer.Argument(help="shopper ids; none = the --limit most recently written")
    ] = None,
    state_dir: StateDir = Path(".state"),
    limit: Annotated[int, typer.Option(min=1, help="with no ids: how many of the newest to show")] = 10,
    from_stack: Annotated[
        bool,
        typer.Option(help="the stack's Redis and key prefix; --no-from-stack: RUNNER_SINKS__* / SINK_* only"),
    ] = True,
) -> None:
    """Read shopper understanding back from Redis, as an ad server would (the stack's key prefix, or
    the one the environment sets: the prefix ``shopper run`` writes under). With no ids, every signal
    key is scanned for its write time (memory stays bounded by ``--limit``): on a large Redis, name ids."""
    from devstack.stack import sink_settings
    from shopper.readback import cell, read_signals, signal_age

    from_env = read_runner_settings().sinks
    sinks = sink_settings(load_state(state_dir), base=from_env) if from_stack else from_env
    rows = asyncio.run(read_signals(sinks.redis_url, shopper_id or [], limit, prefix=sinks.redis_key_prefix))
    columns = ("shopper", "seq", "age s (event / written)", "summary", "interests", "occasion", "price")
    table = Table(*columns, "cached/prompt")
    now = time.time()
    for row in rows:
        table.add_row(
            cell(row["shopper_id"]),
            cell(row["seq"]),
            signal_age(row, now),
            cell(row["summary"]),
            cell(", ".join(json.loads(row["interests"]))),
            cell(row["occasion"] or "-"),
            cell(row["price_sensitivity"]),
            cell(f"{row['cached_tokens']}/{row['prompt_tokens']}"),
        )
    console.print(table)


@app.command("tail-dlq")
def tail_dlq(
    limit: Annotated[int, typer.Option(min=1, help="the newest this many")] = 20,
    bootstrap: str | None = None,
    topic: Annotated[str, typer.Option(help="the dead-letter topic")] = DLQ_TOPIC,
    state_dir: StateDir = Path(".state"),
) -> None:
    """Print dead-lettered messages with their reasons, one bounded, escaped line each.

    A record that is not a dead letter is shown too. Kafka TLS/SASL: RUNNER_KAFKA_SECURITY__*."""
    from shopper.readback import describe_dead_letter, read_dlq_values

    security = kafka_security()
    bootstrap = bootstrap or load_state(state_dir).kafka_bootstrap
    values = read_dlq_values(bootstrap, topic, limit, security=security)
    for value in values:
        reason, original = describe_dead_letter(value)
        # Text: no markup parsed; soft_wrap: one record, one line
        console.print(Text.assemble((reason, "yellow"), "  ", original), soft_wrap=True)
    console.print(f"{len(values)} dead letters shown")


@app.command()
def demo(
    events: int = 6000,
    shoppers: int = 150,
    state_dir: StateDir = Path(".state"),
    keep_stack: bool = False,
    engine: Annotated[
        Engine, typer.Option(help="embedded (the runner) or flink (a local Flink cluster)")
    ] = Engine.embedded,
) -> None:
    """Stack up, produce, run until drained, print what landed in Redis, S3 and the DLQ, stack down."""
    from shopper.demo import run_demo

    code = run_demo(
        state_dir,
        events=events,
        shoppers=shoppers,
        keep_stack=keep_stack,
        console=console,
        engine=engine.value,
    )
    raise typer.Exit(code)


USER_ERRORS = (ShopperError, FileNotFoundError, RedisConnectionError, KafkaException)
"""What a user's settings, input or services got wrong (a setting that cannot work, no stack state, a
Redis or Kafka that does not answer): said in one line, with exit status 1. Anything else is a bug of
ours and keeps its traceback."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one is not waited for
    interrupt()  # at once, or once a process being started is recorded (devstack.processes)


def _interrupt_at_a_safe_point(signum: int, frame: FrameType | None) -> None:
    interrupt()  # Ctrl-C: at once, or once a process being started is recorded


def main() -> None:
    """The ``shopper`` command (``[project.scripts]``, ``python -m shopper``): ``app``, with
    ``USER_ERRORS`` said in one line, and SIGTERM and SIGHUP (a dropped SSH session) taken as Ctrl-C.
    By default either ended a command at once: one stopped while it started processes (``stack up``,
    ``flink up``) left those it had started running, and recorded nowhere; as an interrupt, the
    start's clean-up stops them. Commands that serve (``run``, ``router serve``) set their own
    handlers while they run."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    signal.signal(signal.SIGINT, _interrupt_at_a_safe_point)
    try:
        app()
    except USER_ERRORS as exc:
        error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
        if isinstance(error, KafkaError):
            message = f"Kafka: {error.str()}"
        else:
            message = f"Redis: {exc}" if isinstance(exc, RedisConnectionError) else str(exc)
        console_err.print(f"shopper: {message}", markup=False, style="red", soft_wrap=True)
        sys.stderr.flush()
        sys.exit(1)
