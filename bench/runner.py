"""Embedded runner benchmark: ingest against the machine's limit, and freshness (produce -> Redis).

Scenarios (one run, same machine, same stack):
- ingest vs bare consumer: the same topic is read, each time by a fresh consumer group, by
  (a) a bare confluent-kafka consumer (same poll batch size and consumer settings as the runner; it
  decodes each record's value with orjson, and keeps nothing): what this machine's broker and client
  can deliver, decoded,
  (b) the runner with triggers limited to one prompt per shopper (a per-shopper rate limit of a day),
  so the LLM is not in the window: Kafka consume + parse + sessions + Redis state + commits,
  (c) optionally the runner of another source tree (``--baseline-tree``, e.g. a ``git worktree`` of an
  older commit), for a before/after measured in the same machine state.
  Each case runs in its own process, interleaved, ``--repeats`` times; the table gives the median
  events/s and the median of the per-repeat ratios to the bare consumer (each ratio is taken from two
  runs back to back, so load from other work on the machine mostly cancels);
- llm@0: every trigger calls the simulator at time scale 0 (LLM answers instantly, HTTP still real);
- llm@H100: the simulator at time scale 1 (H100 32B timings), events produced at a fixed rate with
  wall-clock timestamps, freshness = Redis write time - Kafka timestamp of the triggering event.

    python -m bench.runner [--events 60000] [--shoppers 2000] [--repeats 3] [--scenarios ingest]
        [--baseline-tree /tmp/old] [--profile-dir bench/results/profiles]

Results under ``BENCH_RESULTS_DIR`` (``bench/results`` by default): the ingest comparison in
``runner_ingest.json`` (and ``runner_ingest_profile.json`` when profiled), the in-memory steps in
``runner_steps.json``, and llm@0 and the paced run in ``runner.json`` (with the ingest rows where that
ran too). A run of ``ingest`` or ``steps`` alone leaves ``runner.json`` as it was: it once wrote it
with an empty table over the documented one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import REPO, create_topics, machine, percentile, print_table, results_dir, temporary_stack
from devstack.stack import StackState, sink_settings
from prompt_assembly.processor import SessionConfig
from prompt_assembly.triggers import TriggerPolicy
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.progress import RunnerStats
from shopper.producer import produce

RESULTS = results_dir()
ROOT = REPO

BARE_CONSUMER = """
import json, sys, time
import orjson
from confluent_kafka import Consumer
job = json.loads(sys.stdin.read())
consumer = Consumer(job["consumer"])
consumer.subscribe([job["topic"]])
consumed, first, last, cpu_first, cpu_last = 0, None, None, 0.0, 0.0
while consumed < job["events"]:
    messages = consumer.consume(job["batch"], job["timeout"])
    if not messages:
        continue
    if first is None:
        first, cpu_first = time.monotonic(), time.process_time()
    for message in messages:
        if message.error() is None:
            try:
                orjson.loads(message.value())
            except orjson.JSONDecodeError:
                pass
            consumed += 1
    last, cpu_last = time.monotonic(), time.process_time()
consumer.close()
print(json.dumps({"consumed": consumed, "seconds": last - first, "cpu_seconds": cpu_last - cpu_first}))
"""
"""Reads until it has seen ``events`` records, decoding each value with orjson (a malformed one is
counted, as the runner counts it); the window is first batch in -> last batch read, the same window
the runner's ``ingest_rate`` uses. ``cpu_seconds``: the process's CPU time (every thread, librdkafka's
included) over that window."""

BARE_CASE = "bare consumer + orjson decode"

RUNNER = """
import asyncio, json, sys, time
from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.ingest import Ingest
cpu = []
process = Ingest._process
async def timed(self, messages):
    if not cpu:
        cpu.append(time.process_time())
    try:
        return await process(self, messages)
    finally:
        cpu[1:] = [time.process_time()]
Ingest._process = timed
settings = RunnerSettings.model_validate(json.loads(sys.stdin.read()))
stats = asyncio.run(EmbeddedRunner(settings, log=lambda _: None).run())
seconds, consumed = stats.last_event_at - stats.first_event_at, stats.accounting.consumed
print(json.dumps({"consumed": consumed, "seconds": seconds, "cpu_seconds": cpu[-1] - cpu[0]}))
"""
"""The runner of whichever source tree is first on PYTHONPATH (this one, or ``--baseline-tree``).
``cpu_seconds``: the process's CPU time (every thread) from the first poll's processing to the last's,
read around ``Ingest._process`` (once per poll, in both trees)."""


STEPS = """
import gc, json, sys, time
import orjson
from devstack.synthetic import SyntheticStream
import prompt_assembly.events as E
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.triggers import TriggerPolicy
from runner.gc_tuning import streaming_gc
import runner.session_store as S
job = json.loads(sys.stdin.read())
stream = SyntheticStream(shoppers=job["shoppers"], seed=1, malformed_rate=0.005, start_ts=1_761_800_000.0)
values = [stream.next_record()[1] for _ in range(job["events"])]
out = {}
def clock(name, started):
    out.setdefault(name, []).append((time.thread_time() - started) / len(values) * 1e6)
if not job["collector"]:
    gc.disable()
# A tree since 8f743ff names each delta's timer (None: the step below serialises no timer); older ones cannot.
no_timer = (None,) if "wall_deadline" in getattr(S.SessionDelta, "__dataclass_fields__", {}) else ()
for _ in range(job["repeats"]):
    with streaming_gc():
        started = time.thread_time()
        for value in values:
            try:
                orjson.loads(value)
            except orjson.JSONDecodeError:
                pass
        clock("orjson.loads (the bare consumer's decode)", started)
        started = time.thread_time()
        if hasattr(E, "parse_events"):
            gated = E.parse_events(values, [None] * len(values))
            events = [e for e in gated if not isinstance(e, E.MalformedEvent)]
        else:
            events = []
            for value in values:
                try:
                    events.append(E.parse_event(value))
                except E.MalformedEvent:
                    pass
        clock("gate: decode, validate, build the models", started)
        policy = TriggerPolicy(min_prompt_interval_s=86_400, quiet_period_s=86_400, immediate_types=())
        processor = SessionProcessor(SessionConfig(triggers=policy))
        sessions, deltas = {}, []
        cache = getattr(S, "cache_stored", None)
        started = time.thread_time()
        for at in range(0, len(events), job["batch"]):
            touched = set()
            for event in events[at : at + job["batch"]]:
                session = sessions.get(event.shopper_id)
                if session is None:
                    session = sessions[event.shopper_id] = processor.new_session(event.shopper_id)
                applied = processor.apply(session, event, None)
                if cache is not None and applied.outcome == "accepted" and session.entries[-1].event is event:
                    cache(session.entries[-1])  # where the tree's ingest encodes it (runner.ingest)
                touched.add(event.shopper_id)
            deltas += [S.SessionDelta(sid, 0, sessions[sid].take_changes(), *no_timer) for sid in touched]
        clock("session step: apply (+ stored event, this tree), take_changes per poll", started)
        started = time.thread_time()
        for net in S.merge_deltas(deltas).values():
            orjson.dumps(net.header)
            if hasattr(S, "joined_entries"):
                S.joined_entries(net.entries)
            else:
                [entry.to_json() for entry in net.entries]
        clock("save: merge and encode the deltas", started)
print(json.dumps(out))
"""
"""The in-memory steps of ingest, without Kafka or Redis, on the loop thread's CPU clock
(``time.thread_time``), in the tree first on PYTHONPATH (a baseline tree without ``parse_events`` or
``joined_entries`` runs its own gate and encoding); the collector as in the runner
(``streaming_gc``) or, with ``collector`` false, off."""


def steps_table(
    events: int, shoppers: int, repeats: int, baseline: Path | None
) -> tuple[list[list[object]], str]:
    """CPU µs per event of each in-memory step, median (min - max) of ``repeats``, per tree, with the
    collector on and off."""
    trees: dict[str, Path] = {"this tree": ROOT}
    if baseline is not None:
        trees[baseline.name] = baseline
    columns: dict[str, dict[str, list[float]]] = {}
    for name, tree in trees.items():
        for collector in (True, False):
            job = {
                "events": events,
                "shoppers": shoppers,
                "repeats": repeats,
                "batch": 2000,
                "collector": collector,
            }
            columns[f"{name}, collector {'on' if collector else 'off'}"] = _child(STEPS, job, tree)
    steps = list(next(iter(columns.values())))
    rows: list[list[object]] = []
    for step in [*steps, "total"]:
        row: list[object] = [step]
        for result in columns.values():
            values = (
                [sum(v[i] for k, v in result.items() if not k.startswith("orjson")) for i in range(repeats)]
                if step == "total"
                else result[step]
            )
            row.append(f"{statistics.median(values):.2f} ({min(values):.2f} - {max(values):.2f})")
        rows.append(row)
    return rows, print_table(["step: CPU µs per event", *columns], rows)


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
        llm=state.replica_client(max_in_flight=256),
        sinks=sink_settings(state, redis_key_prefix=f"bench-{tag}:", s3_prefix=f"bench-{tag}"),
    )


async def until_assigned(runner: EmbeddedRunner, task: asyncio.Task[Any], timeout_s: float = 60.0) -> None:
    """Until the runner holds its partitions, plus one fetch wait, so that no event of the window waits
    for the consumer group to form. With a fixed 2 s instead, the first twenty or so cart adds of a run
    waited up to 1.8 s for the runner, which was the p99 of the purchase and cart prompts' time to the
    runner (1.1-1.4 s, against at most 0.4 s for every later prompt) and part of their p99 from due."""
    deadline = time.monotonic() + timeout_s
    while not runner.assignment.partitions:
        if task.done():
            task.result()  # the runner failed to start: say why
        if time.monotonic() > deadline:
            raise RuntimeError(f"the runner held no partition after {timeout_s:g} s")
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # librdkafka's fetch.wait.max.ms (500 ms): its first fetch is under way


def create_topic(bootstrap: str, partitions: int = 4) -> str:
    """A new topic with a name of its own."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [name], partitions)
    return name


def run_drained(settings: RunnerSettings) -> tuple[RunnerStats, float]:
    started = time.perf_counter()
    stats = asyncio.run(EmbeddedRunner(settings, log=lambda _: None).run())
    return stats, time.perf_counter() - started - settings.drain_idle_s


def one_prompt_session() -> SessionConfig:
    """No trigger fires while events stream in (nothing prompts at once, browsing waits a day), so the
    ingest window measures ingest alone; every shopper's one prompt fires at the final drain."""
    return SessionConfig(
        triggers=TriggerPolicy(min_prompt_interval_s=86_400, quiet_period_s=86_400, immediate_types=())
    )


def _settings_json(settings: RunnerSettings) -> dict[str, Any]:
    """What was set explicitly (so a baseline tree whose models lack newer fields still reads it)."""
    data = settings.model_dump(mode="json", exclude_unset=True)
    secret = settings.sinks.s3_secret_access_key  # dumped masked; the child process needs the value
    if secret is not None:
        data["sinks"]["s3_secret_access_key"] = secret.get_secret_value()
    return data


def _child(code: str, job: dict[str, Any], tree: Path, profile_out: Path | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with ``tree`` first on the import path; ``profile_out``
    records it with py-spy (sampling, so the measured rate stays close to an unprofiled run)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", code]
    if profile_out is not None:
        py_spy = Path(sys.executable).parent / "py-spy"
        argv = [
            str(py_spy),
            "record",
            "--idle",
            "-r",
            "250",
            "-f",
            "speedscope",
            "-o",
            str(profile_out),
            "--",
            *argv,
        ]
    done = subprocess.run(
        argv, input=json.dumps(job), capture_output=True, text=True, env=env, cwd=tree, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"ingest case failed ({done.returncode}): {done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]  # py-spy prints too
    return dict(json.loads(lines[-1]))


PROFILE_PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("gate: decode + validate (events.parse_event[s])", ("parse_event", "decode_event")),
    ("session log insert + dedup (ShopperSession.add)", ("ShopperSession.add", "ShopperSession.trim_head")),
    ("triggers (TriggerPolicy.next_pending)", ("TriggerPolicy.next_pending",)),
    ("session apply, rest (SessionProcessor.apply)", ("SessionProcessor.apply",)),
    ("prompt rendering (SessionProcessor._emit)", ("SessionProcessor._emit",)),
    ("Redis: session load (load_many)", ("RedisSessionStore.load_many",)),
    ("Redis: session save (deltas encoded, one script call)", ("RedisSessionStore.save",)),
    ("epoch close (take_changes, timers)", ("EmbeddedRunner.close_epoch",)),
    ("dead letters (publish)", ("DeadLetterPublisher.",)),
    ("commit path, rest (S3/DLQ flush, offsets)", ("Committer.",)),
    ("the poll's own loops (Ingest._process)", ("Ingest._process",)),
    ("Kafka poll hand-off (to_thread) + ingest loop", ("Ingest.run",)),
    ("idle: loop waiting (select)", ("EpollSelector.select",)),
]
"""Where a sample of the event-loop thread is attributed: the innermost frame that names one of these
functions wins (so Redis client code under ``save`` counts as the save); anything else is event-loop
scheduling and the rest."""


PROCESS = "Ingest._process"
OTHER = "event loop scheduling, other"


def summarise_profile(path: Path, events: int) -> list[tuple[str, float, float]]:
    """(part, share of the loop thread's time, microseconds per event) over the ingest window: the
    samples from the first to the last in which ``Ingest._process`` runs. py-spy records with
    ``--idle``, so every sample is one tick of wall time on the loop thread."""
    data = json.loads(path.read_text())
    frames = [f"{f['name']}" for f in data["shared"]["frames"]]
    loop_thread = max(data["profiles"], key=lambda profile: len(profile["samples"]))
    samples: list[list[int]] = loop_thread["samples"]
    tick_s = float(loop_thread["weights"][0]) if loop_thread["weights"] else 0.0
    inside = [i for i, stack in enumerate(samples) if any(frames[f] == PROCESS for f in stack)]
    if not inside:
        return []
    window = samples[inside[0] : inside[-1] + 1]
    counts: dict[str, int] = {}
    for stack in window:
        part = OTHER
        for frame in reversed(stack):
            name = frames[frame]
            match = next((p for p, names in PROFILE_PARTS if any(name.startswith(n) for n in names)), None)
            if match is not None:
                part = match
                break
        counts[part] = counts.get(part, 0) + 1
    per_event_us = len(window) * tick_s / events * 1e6
    order = [p for p, _ in PROFILE_PARTS] + [OTHER]
    return [
        (part, counts[part] / len(window), counts[part] / len(window) * per_event_us)
        for part in order
        if part in counts
    ]


def profile_table(profiles: dict[str, Path], events: int) -> tuple[list[list[object]], str]:
    """One row per part: microseconds per event (and share of the loop thread) for each profiled case;
    the rows, and the table as printed."""
    if not profiles:
        return [], ""
    summaries = {
        name: {p: (share, us) for p, share, us in summarise_profile(path, events)}
        for name, path in profiles.items()
    }
    parts = [p for p, _ in PROFILE_PARTS] + [OTHER]
    rows: list[list[object]] = []
    for part in parts:
        if not any(part in summary for summary in summaries.values()):
            continue
        row: list[object] = [part]
        for summary in summaries.values():
            share, us = summary.get(part, (0.0, 0.0))
            row.append(f"{us:.1f} ({share:.0%})")
        rows.append(row)
    totals = [sum(us for _, us in summary.values()) for summary in summaries.values()]
    rows.append(["total (loop thread, ingest window)", *(f"{t:.1f}" for t in totals)])
    return rows, print_table(["part: us per event (share)", *summaries], rows)


def bare_consumer_job(settings: RunnerSettings, events: int) -> dict[str, Any]:
    """The runner's own consumer settings (``runner.ingest.Ingest.consumer_config``) and poll size. Callbacks
    (the runner's ``error_cb``) stay behind: the job crosses to the child process as JSON."""
    config = EmbeddedRunner(settings).ingest.consumer_config()
    return {
        "consumer": {key: value for key, value in config.items() if not callable(value)},
        "topic": settings.topic,
        "events": events,
        "batch": settings.batch_max_events,
        "timeout": settings.poll_timeout_s,
    }


def ingest_comparison(
    state: StackState,
    topic: str,
    events: int,
    repeats: int,
    baseline: Path | None,
    profile_dir: Path | None,
) -> tuple[list[list[object]], dict[str, Any], dict[str, Path]]:
    """Bare consumer, this runner and (optionally) the baseline runner on the same topic, interleaved."""
    cases: dict[str, Path | None] = {BARE_CASE: None, "runner (this tree)": ROOT}
    if baseline is not None:
        cases[f"runner ({baseline.name})"] = baseline
    rates: dict[str, list[float]] = {name: [] for name in cases}
    ratios: dict[str, list[float]] = {name: [] for name in cases}
    cpu_us: dict[str, list[float]] = {name: [] for name in cases}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats):
        bare_rate = bare_cpu = 0.0
        for name, tree in cases.items():
            settings = settings_for(state, topic, one_prompt_session())
            if tree is None:
                result = _child(BARE_CONSUMER, bare_consumer_job(settings, events), ROOT)
            else:
                result = _child(RUNNER, _settings_json(settings), tree)
            if result["consumed"] != events:
                raise RuntimeError(f"{name} consumed {result['consumed']} of {events} events")
            rate = result["consumed"] / result["seconds"]
            per_event_us = result["cpu_seconds"] / result["consumed"] * 1e6
            bare_rate = rate if tree is None else bare_rate
            bare_cpu = per_event_us if tree is None else bare_cpu
            rates[name].append(rate)
            ratios[name].append(rate / bare_rate)
            cpu_us[name].append(per_event_us)
            cpu_ratios[name].append(bare_cpu / per_event_us)
            print(
                f"  repeat {repeat + 1}: {name}: {rate:,.0f} events/s, {per_event_us:.2f} us CPU per event",
                flush=True,
            )
    profiles: dict[str, Path] = {}
    if profile_dir is not None:  # after the timed runs, so profiling never disturbs them
        profile_dir.mkdir(parents=True, exist_ok=True)
        for name, tree in cases.items():
            if tree is None:
                continue
            path = profile_dir / f"runner-{tree.name}.speedscope.json"
            settings = settings_for(state, topic, one_prompt_session())
            result = _child(RUNNER, _settings_json(settings), tree, path)
            print(f"  profiled {name}: {result['consumed'] / result['seconds']:,.0f} events/s -> {path}")
            profiles[name] = path
    rows: list[list[object]] = []
    for name in cases:
        rows.append(
            [
                name,
                events,
                repeats,
                statistics.median(rates[name]),
                f"{min(rates[name]):,.0f} - {max(rates[name]):,.0f}",
                f"{statistics.median(ratios[name]):.2f}",
                f"{min(ratios[name]):.2f} - {max(ratios[name]):.2f}",
                f"{statistics.median(cpu_us[name]):.2f}",
                f"{statistics.median(cpu_ratios[name]):.2f}",
                f"{min(cpu_ratios[name]):.2f} - {max(cpu_ratios[name]):.2f}",
            ]
        )
    raw = {"rates": rates, "ratios": ratios, "cpu_us_per_event": cpu_us, "cpu_ratios": cpu_ratios}
    return rows, raw, profiles


SCENARIOS = ("ingest", "llm0", "paced", "steps")
"""What ``--scenarios`` may name (``steps``: the in-memory steps alone, no stack)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--shoppers", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each ingest case (median)")
    parser.add_argument(
        "--scenarios",
        default="ingest,llm0,paced",
        help=f"comma-separated, of {','.join(SCENARIOS)} (steps: the in-memory steps alone, no stack)",
    )
    parser.add_argument(
        "--baseline-tree", type=Path, default=None, help="another source tree's runner, measured too"
    )
    parser.add_argument(
        "--profile-dir", type=Path, default=None, help="py-spy profile of one more run of each runner case"
    )
    parser.add_argument("--rate", type=float, default=40.0, help="events/s for the freshness run")
    parser.add_argument("--freshness-events", type=int, default=2400)
    args = parser.parse_args()
    scenarios = {s for s in args.scenarios.split(",") if s}
    unknown = sorted(scenarios - set(SCENARIOS))
    if unknown or not scenarios:
        parser.error(
            f"--scenarios: {'unknown ' + ', '.join(unknown) if unknown else 'none given'}; "
            f"choose from {', '.join(SCENARIOS)}"
        )
    rows = []
    ingest_rows: list[list[object]] = []
    ingest_raw: dict[str, Any] = {}
    profile_rows: list[list[object]] = []
    load_before = os.getloadavg()[0]
    print(f"machine: {machine()}; load average {load_before:.2f}")
    if "steps" in scenarios:
        _, text = steps_table(args.events, args.shoppers, args.repeats, args.baseline_tree)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "runner_steps.json").write_text(
            json.dumps(
                {"machine": machine(), "load_average": [load_before, os.getloadavg()[0]], "table": text}
            )
        )
        scenarios.discard("steps")
        if not scenarios:
            return
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
        if "ingest" in scenarios:
            ingest_rows, ingest_raw, profiles = ingest_comparison(
                state, topic, args.events, args.repeats, args.baseline_tree, args.profile_dir
            )
            ingest_table = print_table(
                [
                    "ingest case",
                    "events",
                    "runs",
                    "median events/s",
                    "range",
                    "÷ bare consumer (median)",
                    "÷ bare (min - max)",
                    "CPU µs/event (median)",
                    "÷ bare by CPU (median)",
                    "÷ bare by CPU (min - max)",
                ],
                ingest_rows,
            )
            profile_rows, profile_text = profile_table(profiles, args.events)
            write_ingest_results(ingest_table, ingest_raw, profile_text, load_before)
        if "llm0" in scenarios:
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
    if "paced" in scenarios:
        rows.append(paced_row(args))
    if not rows:  # ingest or steps alone: their own files are written; runner.json keeps its table
        print(f"{RESULTS / 'runner.json'} left as it was (neither llm@0 nor paced ran)")
        return
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
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runner.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "load_average": [load_before, os.getloadavg()[0]],
                "ingest": ingest_rows,
                "ingest_runs": ingest_raw,
                "profile": profile_rows,
                "rows": rows,
                "table": table,
            },
            indent=1,
        )
    )


def write_ingest_results(table: str, runs: dict[str, Any], profile: str, load_before: float) -> None:
    """The ingest comparison on its own, as printed (``runner_ingest.json``) and, when profiled, the
    profile table (``runner_ingest_profile.json``): ``docs/benchmarks.md`` renders both from these
    (``bench.report``'s ``printed_table``), so the documented ratios are the run's."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = [load_before, os.getloadavg()[0]]
    (RESULTS / "runner_ingest.json").write_text(
        json.dumps({"machine": machine(), "load_average": load, "table": table, "runs": runs}, indent=1)
    )
    if profile:
        (RESULTS / "runner_ingest_profile.json").write_text(
            json.dumps({"machine": machine(), "load_average": load, "table": profile}, indent=1)
        )


def paced_row(args: argparse.Namespace) -> list[object]:
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
            await until_assigned(runner, task)
            producer.start()
            await asyncio.to_thread(producer.join)
            await asyncio.sleep(5)
            runner.request_stop()
            return await task

        started = time.perf_counter()
        stats = asyncio.run(timed())
        seconds = time.perf_counter() - started
        fresh = stats.freshness_ms
        return [
            f"paced {args.rate:.0f}/s, LLM@H100 32B",
            args.freshness_events,
            stats.accounting.prompts,
            seconds,
            stats.ingest_rate,
            stats.accounting.consumed / seconds,
            f"p50 {percentile(fresh, 0.5):.0f} / p99 {percentile(fresh, 0.99):.0f}",
            f"{stats.cache_hit_ratio:.2f}",
        ]


if __name__ == "__main__":
    main()
