"""The near-real-time shopper-understanding job on Flink (PyFlink 2.3, DataStream API).

Topology with its own async stage (``prompts_topic`` empty; one chain per stage; JSON strings between
operators)::

    Kafka source (Table API: raw value + metadata; shopper id read by JSON_VALUE, keyed on the JVM)
      -> ShopperSessionFunction, keyed      gate (rejected -> DLQ side output -> Kafka table sink,
                                            keyed by the original record's Kafka key)
         (thread mode by default: in the    session state (TTL) + timers -> PromptRequest
         TaskManager's JVM, no bundle)
      -> EnrichAndWrite (async, unordered)  LLM client (session affinity) -> EnrichmentResult, then
         (always a process-mode worker)     Redis signals + S3 objects, durable before each checkpoint
      -> Kafka table sink(shopper-insights) keyed by shopper id (JSON_VALUE on the JVM), exactly-once,
                                            explicit transaction timeout (optional)

By default (``prompts_topic``) the job ends at the session stage: its prompts go, keyed by shopper id, to
that topic (at least once, sent as they are made), and a runner with ``input`` 'prompts' (the enrichment
runner, ``devstack.enrichment_stage``) enriches and stores them, with no bundle and no drain on the
call's path (docs/flink.md, "Prompts topic").

Run it on a cluster with ``flink run -py flink_jobs/near_realtime.py --config job.yaml``, or locally in
the MiniCluster on a bounded sample with ``python -m devstack.flink_local``. Tests call
``run_bounded(events, settings)``: the same topology with the Kafka source and sinks swapped for a
bounded collection and a collect sink.

End of a bounded input: the source's final watermark (Long.MAX_VALUE) reaches an event-time timer that
the session function keeps at ``FLUSH_TIMER_TS`` while a trigger is pending, and that timer calls
``SessionProcessor.flush``. Processing-time timers cannot do this: Flink drops pending processing-time
timers when an input ends. In bounded runs the processing-time timers are off by default, so prompts
depend only on each shopper's event order (what the embedded runner also guarantees), not on wall time.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.redaction import redacted_config_dump

PYTHON_STAGE_UIDS = ("shopper-sessions", "enrich-and-write")


def job_configuration(settings: NearRealtimeSettings, *, local: bool) -> Any:
    """Flink configuration from the settings: checkpoints, state backend, restarts, Python bundles."""
    from pyflink.common import Configuration

    conf = Configuration()
    cp, restart, aio = settings.checkpoint, settings.restart, settings.async_io
    values: dict[str, str] = {
        "pipeline.name": settings.job_name,
        "execution.checkpointing.interval": f"{cp.interval_ms} ms",
        "execution.checkpointing.mode": cp.mode.upper(),
        "execution.checkpointing.timeout": f"{cp.timeout_ms} ms",
        "execution.checkpointing.min-pause": f"{cp.min_pause_ms} ms",
        "execution.checkpointing.dir": cp.directory,
        "execution.checkpointing.incremental": str(cp.incremental).lower(),
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "state.backend.type": cp.state_backend,
        "restart-strategy.type": restart.strategy,
        "python.fn-execution.bundle.size": str(aio.bundle_size),
        "python.fn-execution.bundle.time": str(aio.bundle_time_ms),
        "execution.buffer-timeout.interval": f"{settings.buffer_timeout_ms} ms",
        "python.metric.enabled": "true",
        # Python operator chaining (fusing consecutive Python operators into one worker) duplicates the
        # operators downstream of a Python operator with a side output in PyFlink 2.3: every prompt was
        # enriched and written twice (and uids collide). Unfused, each stage has its own worker.
        "python.operator-chaining.enabled": "false",
    }
    if restart.strategy == "fixed-delay":
        values["restart-strategy.fixed-delay.attempts"] = str(restart.attempts)
        values["restart-strategy.fixed-delay.delay"] = f"{restart.initial_delay_ms} ms"
    elif restart.strategy == "exponential-delay":
        values["restart-strategy.exponential-delay.initial-backoff"] = f"{restart.initial_delay_ms} ms"
        values["restart-strategy.exponential-delay.max-backoff"] = f"{restart.max_delay_ms} ms"
    python = settings.python_executable or (sys.executable if local else None)
    if python:
        values["python.executable"] = python
        values["python.client.executable"] = python
    if settings.session_stage_mode == "thread":
        # The job-wide mode must say 'thread' at run time (an embedded operator refuses to open
        # otherwise); the async stage is built as a process-mode operator (``async_stage``), which
        # runs in its worker whatever this says. The embedded interpreter does not read the venv's
        # .pth files, so it gets the job's packages on python.pythonpath.
        values["python.execution-mode"] = "thread"
        values["python.pythonpath"] = settings.python_path or default_python_path()
    for key, value in values.items():
        conf.set_string(key, value)
    return conf


def create_environment(settings: NearRealtimeSettings, *, local: bool, jars: Sequence[str] = ()) -> Any:
    from pyflink.datastream import StreamExecutionEnvironment

    env = StreamExecutionEnvironment.get_execution_environment(job_configuration(settings, local=local))
    env.set_parallelism(settings.parallelism)
    env.set_max_parallelism(settings.max_parallelism)
    if jars:
        env.add_jars(*jars)
    return env


def default_python_path() -> str:
    """This interpreter's site-packages and the project root (an editable install is a .pth file)."""
    import site
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([*site.getsitepackages(), root])


@contextmanager
def async_stage(stream: Any) -> Iterator[None]:
    """Build the async operators inside with ``python.execution-mode`` = 'process'. PyFlink picks a
    Python operator's Java class (embedded in the JVM for 'thread', a Beam worker for 'process') from
    the environment's configuration when the operator is added, and has no async function in thread
    mode; so with ``session_stage_mode`` 'thread' the session stage is embedded and the async stage
    still gets its worker (whose operator does not read the mode again at run time)."""
    from pyflink.util.java_utils import get_j_env_configuration

    conf = get_j_env_configuration(stream._j_data_stream.getExecutionEnvironment())
    key = "python.execution-mode"
    before = conf.getString(key, "process")
    conf.setString(key, "process")
    try:
        yield
    finally:
        conf.setString(key, before)


@dataclass
class Pipeline:
    results: Any
    """DataStream[str] of EnrichmentResult JSON, after they are durable in Redis and S3; None with
    ``prompts_topic`` (the job then ends at its session stage)."""
    dlq: Any
    """DataStream[Row(kafka_key, letter)] of DLQ JSON records with their original's Kafka key
    (``flink_connectors.DLQ_RECORD``)."""
    prompts: Any = None
    """With ``prompts_topic``: DataStream[str] of PromptRequest JSON, for that topic."""


def build_pipeline(
    keyed: Any,
    settings: NearRealtimeSettings,
    *,
    source_topic: str | None,
    processing_time_timers: bool = True,
    flush_at_end: bool = True,
    base64_values: bool = False,
) -> Pipeline:
    """Everything between the source and the sinks; ``keyed`` is a KeyedStream of source records keyed
    by shopper id (``kafka_keyed_records`` or ``bounded_keyed_records``).

    Two Python stages: the gate + sessions (keyed), and enrichment + sink writes (async). Each Python
    stage holds its input for up to one bundle time and drains at each bundle end, so fewer stages is
    what cuts the added latency (docs/flink.md, "Latency")."""
    from pyflink.common import Types

    from flink_jobs.flink_functions import DLQ_TAG, ShopperSessionFunction

    settings_json = settings.to_json()
    prompts = (
        keyed.process(
            ShopperSessionFunction(
                settings_json, processing_time_timers, flush_at_end, source_topic, base64_values
            ),
            output_type=Types.STRING(),
        )
        .name("gate and shopper sessions")
        .uid("shopper-sessions")
    )
    dlq = prompts.get_side_output(DLQ_TAG)
    if settings.prompts_topic:
        return Pipeline(results=None, dlq=dlq, prompts=prompts)
    with async_stage(prompts):
        return _async_stages(prompts, dlq, settings, settings_json)


def _async_stages(prompts: Any, dlq: Any, settings: NearRealtimeSettings, settings_json: str) -> Pipeline:
    """Enrichment and sink writes: one async stage, or two where Flink-level retries are on."""
    from pyflink.common import Types
    from pyflink.common.time import Time
    from pyflink.datastream import async_retry_strategies
    from pyflink.datastream.async_data_stream import AsyncDataStream

    from flink_jobs.flink_functions import EnrichAndWrite, EnrichPrompts, WriteResults, is_retryable_result

    aio = settings.async_io
    if settings.result_sinks and aio.retry_attempts == 0:
        # Timeouts are enforced on the event loop: a Flink-level timeout costs PyFlink one OS thread per
        # in-flight record (see AsyncSettings).
        results = (
            AsyncDataStream.unordered_wait(
                prompts,
                EnrichAndWrite(settings_json),
                Time.milliseconds(0),
                capacity=aio.capacity,
                output_type=Types.STRING(),
            )
            .name(f"enrich prompts (LLM), write {', '.join(settings.result_sinks)}")
            .uid("enrich-and-write")
        )
        return Pipeline(results=results, dlq=dlq)
    flink_timeout = Time.milliseconds(0)
    retry = async_retry_strategies.NO_RETRY_STRATEGY
    if aio.retry_attempts > 0:
        flink_timeout = Time.milliseconds(aio.timeout_ms * (aio.retry_attempts + 1))
        retry = async_retry_strategies.ExponentialBackoffDelayRetryStrategy(
            aio.retry_attempts, aio.retry_backoff_ms, aio.retry_backoff_ms * 8, 2.0, is_retryable_result, None
        )
    results = (
        AsyncDataStream.unordered_wait_with_retry(
            prompts,
            EnrichPrompts(settings_json),
            flink_timeout,
            retry,
            capacity=aio.capacity,
            output_type=Types.STRING(),
        )
        .name("enrich prompts (LLM)")
        .uid("enrich-prompts")
    )
    if settings.result_sinks:
        results = (
            AsyncDataStream.unordered_wait(
                results,
                WriteResults(settings_json),
                Time.milliseconds(0),  # WriteResults enforces sink_timeout_ms itself
                capacity=aio.sink_capacity,
                output_type=Types.STRING(),
            )
            .name(f"write {', '.join(settings.result_sinks)}")
            .uid("write-results")
        )
    return Pipeline(results=results, dlq=dlq)


# ---- cluster / Kafka -------------------------------------------------------------------------------
def run_kafka(
    settings: NearRealtimeSettings,
    *,
    local: bool = False,
    detached: bool = False,
    stop_at_latest: bool = False,
) -> None:
    """The production job: Kafka in, DLQ out, and either prompts out to ``prompts_topic`` (the default,
    for the enrichment runner) or, with its own async stage, Redis and S3 through the sinks and
    (optionally) the insights topic.
    ``stop_at_latest`` reads only what the topic holds now and then ends, flushing every pending trigger."""
    from flink_jobs.flink_connectors import (
        kafka_connector_jars,
        kafka_source_rows,
        sink_dead_letters,
        sink_keyed_by_shopper,
        table_environment,
    )

    jars = kafka_connector_jars()  # fails fast, naming scripts/fetch-flink-connectors
    env = create_environment(settings, local=local, jars=jars)
    exactly_once = settings.checkpoint.mode == "exactly_once"
    t_env = table_environment(env)
    keyed = kafka_source_rows(env, settings, stop_at_latest=stop_at_latest, t_env=t_env)
    pipeline = build_pipeline(
        keyed,
        settings,
        source_topic=settings.kafka.events_topic,
        processing_time_timers=settings.wall_clock_timers and not stop_at_latest,
        flush_at_end=stop_at_latest or settings.flush_on_drain,
    )
    sink_dead_letters(t_env, pipeline.dlq, settings)  # keyed by each original's Kafka key
    if pipeline.prompts is not None:  # prompts_topic: a runner with input 'prompts' enriches them
        sink_keyed_by_shopper(
            t_env,
            pipeline.prompts,
            settings,
            settings.prompts_topic or "",
            exactly_once=False,
            name="prompts",
        )
    elif settings.insights_topic:
        sink_keyed_by_shopper(
            t_env,
            pipeline.results,
            settings,
            settings.insights_topic,
            exactly_once=exactly_once,
            name="shopper_insights",
        )
    if detached:
        env.execute_async(settings.job_name)
    else:
        env.execute(settings.job_name)


# ---- bounded (tests, --local) ------------------------------------------------------------------------
@dataclass
class BoundedRun:
    results: list[str] = field(default_factory=list)
    dlq: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_bounded(
    events: Sequence[bytes | str],
    settings: NearRealtimeSettings,
    *,
    processing_time_timers: bool = False,
) -> BoundedRun:
    """The job's topology on a bounded in-memory input, in the local MiniCluster (with
    ``prompts_topic``, ``results`` holds the prompts the job would send there).

    Every session's pending trigger fires at the end (final watermark), so every accepted event is in
    some prompt. Redis and S3 are written through the sinks as in production; the results and DLQ
    records are also collected and returned (they would go to Kafka topics on a cluster).
    """
    from pyflink.common import Types

    started = time.monotonic()
    env = create_environment(settings, local=True)
    # Bytes as they would come off Kafka. The collection travels base64-encoded (PyFlink's collection
    # bridge cannot carry raw byte arrays, and a str coder would reject non-UTF-8); the parse step
    # decodes it, so the bounded job has exactly the production operators after the source.
    values = [
        base64.b64encode(e.encode("utf-8") if isinstance(e, str) else bytes(e)).decode() for e in events
    ]
    raw = env.from_collection(values, type_info=Types.STRING()).name("bounded events").uid("bounded-source")
    from flink_jobs.flink_functions import shopper_key

    pipeline = build_pipeline(
        raw.key_by(shopper_key, key_type=Types.STRING()),
        settings,
        source_topic=None,
        processing_time_timers=processing_time_timers,
        flush_at_end=True,
        base64_values=True,
    )
    run = BoundedRun()
    # One collect sink for both streams; dead letters carry their format tag.
    from pipeline.dead_letter import is_dead_letter

    made = pipeline.results if pipeline.prompts is None else pipeline.prompts  # prompts_topic: the prompts
    letters = pipeline.dlq.map(lambda record: record[1], output_type=Types.STRING())  # no key: no Kafka
    with made.union(letters).execute_and_collect(settings.job_name) as records:
        for record in records:
            (run.dlq if is_dead_letter(record) else run.results).append(record)
    run.seconds = time.monotonic() - started
    return run


# ---- CLI -----------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flink run -py flink_jobs/near_realtime.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", help="YAML or JSON file with NearRealtimeSettings fields")
    parser.add_argument("--detached", action="store_true", help="submit and return")
    parser.add_argument(
        "--until-latest",
        action="store_true",
        help="bounded: read what the topic holds at start, flush every pending trigger, finish",
    )
    args = parser.parse_args(argv)
    settings = NearRealtimeSettings.load(args.config)
    print(f"settings: {redacted_config_dump(settings)}", flush=True)
    try:
        run_kafka(settings, detached=args.detached, stop_at_latest=args.until_latest)
    except Exception as exc:
        from flink_jobs.flink_connectors import MissingConnectorJar

        if isinstance(exc, MissingConnectorJar):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
