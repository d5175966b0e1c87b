"""Overload benchmark: the embedded runner at 1x, 2x and 3x of the fleet's measured capacity,
once per overload policy (``pipeline.overload``: ``fifo``, ``latest_wins``, ``latest_wins_priority``).

The stack: Tansu, Redis, moto and simulated H100 replicas (32B, time scale 1, the simulator's defaults:
real-sized KV cache, ``guaranteed_no_evict``). Events come from the synthetic stream
(``devstack.synthetic``: its order and mix, browse, cart, purchase, Zipf-hot shoppers) stamped with the
wall clock at send (event time = Kafka timestamp), each shopper sending ``--per-shopper`` events/s on
average: a higher rate is more shoppers, as on a peak day, not faster ones.

Capacity is measured first, in the same run: ``--probe-shoppers`` (well past what the fleet answers) for
``--probe-seconds`` under ``latest_wins`` with in-flight cancelling off (so the fleet stays busy and
nothing it computes is thrown away); the requests the replicas finish per second over the probe's second
half is the fleet's capacity in prompts/s. Each multiple's shopper count is the one whose triggers make
that many times the capacity in prompts/s, computed beforehand from the same stream through the session
logic (``offline_prompts_per_s``); every run also reports the load it actually offered (prompts due/s ÷
capacity).

What each run (one policy, one rate, ``--seconds`` of production, the same stream for every policy)
measures, from the runner's own prompt flight (``runner.prompt_flight``, recorded as it goes):

- a prompt's *trigger instant*: the Kafka timestamp of the event whose arrival made it due (what the
  runner's freshness uses), or, for a trigger fired by the wall clock (a browse pause, a rate-limited
  cart add), the instant its timer fired;
- freshness of a landed signal: trigger instant -> its write to Redis; p50/p99, and p99 of the first
  and last third of the window (by trigger instant), to show whether it grows;
- by trigger kind, from the Kafka timestamp of the newest event in the prompt (the policy's own wait
  included: a browse pause's quiet period, a cart add's rate limit) and from the trigger instant;
- the age of the shoppers' signals at random instants: 0 when a shopper's signal reflects its newest
  trigger, else the time since the first trigger it does not reflect yet;
- tokens at the replicas (``/admin/stats``: prefill computed, decode), per landed insight, and the share
  spent on prompts whose answer never landed (superseded in flight, errors): all computed tokens less
  those of the landed insights (their uncached prompt tokens and their completion tokens after the first,
  which the prefill pass produces);
- prompts = insights + errors + superseded (queued, cancelled in flight, dropped stale).

    python -m bench.overload [--seconds 120] [--rates 1,2,3] [--arms fifo,latest_wins,latest_wins_priority]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import heapq
import json
import os
import pickle
import random
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import Producer

from bench.common import (
    machine,
    machine_busy_seconds,
    paced,
    percentile,
    print_table,
    results_dir,
    temporary_stack,
)
from bench.fleet import reset_caches
from bench.runner import create_topic, settings_for, until_assigned
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.enrichment import EnrichmentSettings
from pipeline.overload import OverloadPolicy, OverloadSettings
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import (
    EnrichmentResult,
    PromptRequest,
    ShopperInsight,
    Superseded,
    parse_result,
)
from prompt_assembly.session import ShopperSession
from runner.embedded import EmbeddedRunner
from runner.prompt_flight import PromptFlight
from serving.simulator.config import SimulatorConfig
from serving.simulator.trtllm_options import AGGREGATED_YAML

if TYPE_CHECKING:
    from runner.epochs import Epoch

ARMS: tuple[OverloadPolicy, ...] = ("fifo", "latest_wins", "latest_wins_priority")
REPLICAS = 3
KINDS = ("purchase", "add_to_cart", "browse_pause")
GROWTH_LIMIT = 1.25
"""The last third's p99 over the first third's above which freshness counts as growing."""


# ---- what the runner did, recorded as it goes ---------------------------------------------------------
@dataclass(slots=True)
class Launched:
    shopper_id: str
    version: tuple[int, int]
    reason: str
    launched_at: float
    trigger_at: float
    """Kafka timestamp of the event that made it due, or the launch instant when a timer fired it."""
    newest_event_id: str | None


@dataclass(slots=True)
class Stored:
    kind: str
    stored_at: float
    cause: str | None = None
    cancelled_in_flight: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    enricher_ms: float = 0.0
    """Admission wait + the model's latency (``ShopperInsight``): from the enricher's start."""
    admission_wait_ms: float = 0.0
    ttft_ms: float = 0.0
    """Request sent -> first token: the wait at the replica (KV memory, a batch slot) and the prefill."""
    latency_ms: float = 0.0

    @property
    def landed_tokens(self) -> tuple[int, int]:
        """An insight's own prefill (its uncached prompt) and decode (its completion after the first
        token, which the prefill pass produces): what landed, so not wasted."""
        return self.prompt_tokens - self.cached_tokens, max(0, self.completion_tokens - 1)

    @classmethod
    def of(cls, result: EnrichmentResult, stored_at: float) -> Stored:
        """What a result says of its prompt's fate, tokens and timings, stored at ``stored_at``."""
        stored = cls(result.kind, stored_at)
        if isinstance(result, ShopperInsight):
            stored.prompt_tokens = result.usage.prompt_tokens
            stored.cached_tokens = result.usage.cached_tokens
            stored.completion_tokens = result.usage.completion_tokens
            stored.enricher_ms = result.admission_wait_ms + result.latency_ms
            stored.admission_wait_ms = result.admission_wait_ms
            stored.ttft_ms = result.ttft_ms
            stored.latency_ms = result.latency_ms
        elif isinstance(result, Superseded):
            stored.cause = result.cause
            stored.cancelled_in_flight = result.cancelled_in_flight
        return stored


class RecordingFlight(PromptFlight):
    """The runner's prompt flight, noting when each prompt became due and when its result was stored
    (after ``checkpoint.write``: the Redis signal is written by then)."""

    def __init__(self, runner: EmbeddedRunner) -> None:
        super().__init__(runner)
        self.launched: dict[str, Launched] = {}
        self.stored: dict[str, Stored] = {}

    def launch(self, prompt: PromptRequest, epoch: Epoch, kafka_ts: float | None) -> None:
        now = time.time()
        self.launched[prompt.request_id] = Launched(
            prompt.shopper_id,
            (prompt.session_epoch, prompt.seq),
            prompt.reason,
            now,
            kafka_ts if kafka_ts else now,
            prompt.new_event_ids[-1] if prompt.new_event_ids else None,
        )
        super().launch(prompt, epoch, kafka_ts)

    async def _store_result(self, result: EnrichmentResult) -> None:
        await super()._store_result(result)
        self.stored[result.request_id] = Stored.of(result, time.time())


# ---- the stream ----------------------------------------------------------------------------------------
def stamped(stream: SyntheticStream, at: float) -> tuple[bytes, bytes, str]:
    """The stream's next event (its order and mix: Zipf-hot shoppers, bursts, a cart before a
    purchase), stamped ``at``: event time is the wall clock at send, as on a live site."""
    key, value, _bad = stream.next_record()
    event = orjson.loads(value)
    event["ts"] = at
    return key, orjson.dumps(event), str(event["event_id"])


def produce_paced(
    bootstrap: str, topic: str, rate: float, seconds: float, shoppers: int, seed: int, sent: dict[str, float]
) -> None:
    """The synthetic stream at ``rate`` events/s for ``seconds``, each event's time and Kafka timestamp
    the wall clock at its send (kept in ``sent`` by event id)."""
    stream = SyntheticStream(shoppers=shoppers, seed=seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log.connection.close": False})
    for _ in paced(rate, seconds):
        at = round(time.time(), 3)
        key, value, event_id = stamped(stream, at)
        producer.produce(topic, key=key, value=value, timestamp=int(at * 1000))
        sent[event_id] = at
        producer.poll(0)
    if producer.flush(30):
        raise RuntimeError("events not delivered to the broker within 30 s")


def offline_prompts_per_s(shoppers: int, rate: float, seconds: float, seed: int) -> float:
    """Prompts per second the runner's triggers make of this stream at ``rate`` events/s, computed
    without a broker: the session logic (``SessionProcessor``) on the same stamped events, each pending
    trigger fired at its due time as the runner's timers do (``timer_wall_per_event_s`` 1)."""
    stream = SyntheticStream(shoppers=shoppers, seed=seed)
    processor = SessionProcessor(SessionConfig())
    sessions: dict[str, ShopperSession] = {}
    timers: list[tuple[float, str]] = []
    prompts = 0
    start = 1_800_000_000.0
    for n in range(int(rate * seconds)):
        at = start + n / rate
        while timers and timers[0][0] <= at:
            due, sid = heapq.heappop(timers)
            prompts += len(processor.fire_pending(sessions[sid], due))
        _key, value, _id = stamped(stream, at)
        event = parse_event(value, at)
        session = sessions.get(event.shopper_id)
        if session is None:
            session = sessions[event.shopper_id] = processor.new_session(event.shopper_id)
        prompts += len(processor.apply(session, event).prompts)
        if session.pending is not None:
            heapq.heappush(timers, (session.pending.due_ts, event.shopper_id))
    end = start + seconds
    prompts += sum(len(processor.fire_pending(sessions[sid], due)) for due, sid in timers if due <= end)
    return prompts / seconds


def shoppers_for(prompts_s: float, per_shopper_s: float, seconds: float, seed: int) -> int:
    """How many shoppers, each sending ``per_shopper_s`` events/s on average, make ``prompts_s`` prompts
    per second (bisection on ``offline_prompts_per_s``, which grows with the shoppers)."""

    def made(shoppers: int) -> float:
        return offline_prompts_per_s(shoppers, shoppers * per_shopper_s, seconds, seed)

    low, high = 10, 40
    while made(high) < prompts_s:
        low, high = high, high * 2
        if high > 200_000:
            raise RuntimeError(f"no shopper count makes {prompts_s:.1f} prompts/s")
    while high - low > max(2, low // 50):
        mid = (low + high) // 2
        if made(mid) < prompts_s:
            low = mid
        else:
            high = mid
    return high


# ---- the replicas ----------------------------------------------------------------------------------------
def _http(url: str, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


ANSWER_COUNTS = {"served", "aborted"}
"""Engine counters of answers: under P/D a context server's count its context steps, not answers."""


def engine_totals(state: StackState) -> dict[str, float]:
    """The replicas' engine counters summed (``/admin/stats``); under P/D the tokens and iterations of
    both pools, and the answers of the generation servers, and each pool's own sums too
    (``context.NAME``, ``generation.NAME``: whether the decode servers also prefilled)."""
    totals: dict[str, float] = defaultdict(float)
    for url in [*state.llm_endpoints, *state.context_endpoints]:
        context = url in state.context_endpoints
        for name, value in _http(f"{url.rstrip('/')}/admin/stats")["engine"].items():
            if not (context and name in ANSWER_COUNTS):
                totals[name] += value
            if state.context_endpoints:
                totals[f"{'context' if context else 'generation'}.{name}"] += value
    return dict(totals)


# ---- one run ----------------------------------------------------------------------------------------
@dataclass
class Run:
    arm: str
    rate: float
    seconds: float
    started: float = 0.0
    """Wall time the producer started: the window is [started, started + seconds]."""
    launched: dict[str, Launched] = field(default_factory=dict)
    stored: dict[str, Stored] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    accounting: dict[str, int] = field(default_factory=dict)
    overload_counts: dict[str, int] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)
    served_trace: list[tuple[float, float]] = field(default_factory=list)
    """(wall time, requests the replicas finished so far in this run), every 2 s."""
    limit_trace: list[tuple[float, int]] = field(default_factory=list)
    """(wall time, the admission gate's limit), every 2 s."""
    drain_s: float = 0.0
    load_average: tuple[float, float] = (0.0, 0.0)
    paused_times: int = 0
    """Times the runner paused its partitions: prompts in flight past ``max_in_flight_prompts``."""
    cores_busy: float = 0.0
    """Cores this whole machine kept busy over the run (``machine_busy_seconds``): other work included."""
    landed_after_window: tuple[int, int] = (0, 0)
    """Uncached prompt and decode tokens of insights landed for prompts due after the window (the Flink
    run waits for them, and they are not in ``stored``): landed, so not wasted."""


async def run_once(
    state: StackState,
    policy: OverloadSettings,
    rate: float,
    seconds: float,
    *,
    shoppers: int,
    seed: int,
    grace_s: float,
    label: str,
    consume_all_s: float = 0.0,
    max_in_flight_prompts: int | None = None,
) -> Run:
    """One policy at one rate: the runner on a fresh topic and Redis prefix, the replicas' caches
    emptied, the stream produced for ``seconds``, then ``grace_s`` more and a draining stop.
    ``consume_all_s``: before that, wait (at most this long) until the runner has read every event sent,
    so that no trigger of the window is left unread when it stops."""
    reset_caches([*state.llm_endpoints, *state.context_endpoints])
    before = engine_totals(state)
    topic = create_topic(state.kafka_bootstrap)
    settings = settings_for(state, topic, SessionConfig(), until_drained=False)
    settings.enrichment = EnrichmentSettings(overload=policy)
    if max_in_flight_prompts is not None:
        settings.max_in_flight_prompts = max_in_flight_prompts
    runner = EmbeddedRunner(settings, log=lambda line: print(f"    {label}: {line}", flush=True))
    flight = RecordingFlight(runner)
    runner.prompts = flight
    run = Run(label, rate, seconds, launched=flight.launched, stored=flight.stored)
    load_before, busy_before, wall_before = os.getloadavg()[0], machine_busy_seconds(), time.monotonic()

    def produce() -> None:
        produce_paced(state.kafka_bootstrap, topic, rate, seconds, shoppers, seed, run.sent)

    async def trace() -> None:
        while True:
            served = (await asyncio.to_thread(engine_totals, state))["served"] - before["served"]
            run.served_trace.append((time.time(), served))
            if runner.enrichment is not None:
                run.limit_trace.append((time.time(), runner.enrichment.gate.limit))
            await asyncio.sleep(2)

    task = asyncio.create_task(runner.run())
    await until_assigned(runner, task)
    tracer = asyncio.create_task(trace())
    run.started = time.time()
    await asyncio.to_thread(produce)
    waited_until = time.monotonic() + consume_all_s
    while runner.stats.accounting.consumed < len(run.sent) and time.monotonic() < waited_until:
        await asyncio.sleep(1)
    await asyncio.sleep(grace_s)
    stop_at = time.monotonic()
    runner.request_stop()
    stats = await task
    run.drain_s = time.monotonic() - stop_at
    await asyncio.sleep(2)  # a request cancelled at the stop leaves the engine at its next disconnect poll
    tracer.cancel()
    after = engine_totals(state)
    run.engine = {name: after[name] - before.get(name, 0) for name in after}
    run.accounting = stats.accounting.as_dict()
    run.paused_times = stats.paused_times
    run.overload_counts = runner.enricher.counts.as_dict()
    run.load_average = (load_before, os.getloadavg()[0])
    run.cores_busy = (machine_busy_seconds() - busy_before) / (time.monotonic() - wall_before)
    return run


# ---- the Flink job ----------------------------------------------------------------------------------
def run_once_flink(
    state: StackState,
    flink_dir: Path,
    cluster: Any,
    policy: OverloadSettings,
    rate: float,
    seconds: float,
    *,
    shoppers: int,
    seed: int,
    grace_s: float,
    label: str,
    via_prompts_topic: bool = False,
) -> Run:
    """One policy at one rate on the Flink job (``flink_jobs.near_realtime``, its live defaults: wall-clock
    timers, the same session settings as the runner's run) on a local cluster: a fresh job, topics and
    Redis prefix, the replicas' caches emptied, the stream produced for ``seconds``; then every record
    committed and the replicas quiet past a browse pause and a rate limit, so every pending trigger has
    fired and every prompt has its result, then the job cancelled.

    The job keeps no prompt flight, so the run is read from its results (every one goes to S3): a
    prompt's trigger instant is its ``due_ts`` (event time = the wall clock at send here), its result's
    instant ``produced_at`` (the Redis write follows in the same operator), and the prompt's start at
    the enrichment is ``produced_at`` less the admission wait and the model's latency. The freshness
    figures take the prompts due by the end of production plus ``grace_s``, as the runner's stop does;
    the accounting takes them all, and names the valid events no result names (none should be).

    ``via_prompts_topic``: the job ends at its session stage (``prompts_topic``) and a runner with input
    'prompts' enriches (``bench.flink_kit.prompts_stage``), stopped after the job is cancelled."""
    from bench.flink_kit import bench_job, drained, prompts_stage, with_live_defaults
    from devstack.flink_cluster import FlinkRest, submit
    from devstack.stack import sink_settings
    from shopper.readback import list_s3_records

    tag = uuid.uuid4().hex[:8]
    settings = with_live_defaults(bench_job(state, flink_dir, tag, {}, live=False))
    settings = settings.model_copy(
        update={"enrichment": settings.enrichment.model_copy(update={"overload": policy})}
    )
    reset_caches([*state.llm_endpoints, *state.context_endpoints])
    before = engine_totals(state)
    run = Run(label, rate, seconds)
    load_before, busy_before, wall_before = os.getloadavg()[0], machine_busy_seconds(), time.monotonic()
    rest = FlinkRest(cluster.web_url)
    topic = settings.kafka.events_topic
    with contextlib.ExitStack() as stages:
        if via_prompts_topic:
            settings = stages.enter_context(
                prompts_stage(state, settings, lambda line: print(f"    {label}: {line}", flush=True))
            )
        job = submit(cluster, settings, config_path=flink_dir / "flink" / f"overload-{tag}.json")
        try:
            rest.wait_running(job.job_id)
            time.sleep(2)
            run.started = time.time()
            produce_paced(state.kafka_bootstrap, topic, rate, seconds, shoppers, seed, run.sent)
            stop_at = time.monotonic()
            ends = drained(state, settings, live=True)
            run.drain_s = time.monotonic() - stop_at
        finally:
            rest.cancel(job.job_id)
    after = engine_totals(state)
    run.engine = {name: after[name] - before.get(name, 0) for name in after}
    sinks = sink_settings(
        state, redis_key_prefix=settings.sinks.redis_key_prefix, s3_prefix=settings.sinks.s3_prefix
    )
    _, records = list_s3_records(sinks, sinks.s3_prefix)
    results: dict[str, EnrichmentResult] = {}
    for record in records:
        results.setdefault(str(record["request_id"]), parse_result(orjson.dumps(record)))
    counted: dict[str, int] = defaultdict(int)
    named: set[str] = set()
    cutoff = run.started + seconds + grace_s
    for rid, result in results.items():
        counted[result.kind] += 1
        named.update(result.new_event_ids, result.trimmed_event_ids)
        stored = Stored.of(result, result.produced_at)
        if result.due_ts > cutoff:
            if isinstance(result, ShopperInsight):
                (prefill, decode), (more_prefill, more_decode) = run.landed_after_window, stored.landed_tokens
                run.landed_after_window = (prefill + more_prefill, decode + more_decode)
            continue
        run.stored[rid] = stored
        started_at = result.produced_at - stored.enricher_ms / 1000
        run.launched[rid] = Launched(
            result.shopper_id,
            (result.session_epoch, result.seq),
            result.reason,
            started_at,
            result.due_ts,
            result.new_event_ids[-1] if result.new_event_ids else None,
        )
    run.accounting = {
        "consumed": sum(ends.values()),
        "prompts": len(results),
        "insights": counted["insight"],
        "errors": counted["error"],
        "superseded": counted["superseded"],
        "events_unnamed": len(set(run.sent) - named),
    }
    run.load_average = (load_before, os.getloadavg()[0])
    run.cores_busy = (machine_busy_seconds() - busy_before) / (time.monotonic() - wall_before)
    return run


# ---- what a run shows ----------------------------------------------------------------------------------
def _p(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 2)


def sampled_ages(run: Run, samples: int, rng: random.Random) -> list[float]:
    """At ``samples`` random instants of the window, for every shopper with a trigger by then: 0 when its
    signal reflects its newest trigger, else the seconds since its first trigger the signal lacks."""
    triggers: dict[str, list[tuple[float, tuple[int, int]]]] = defaultdict(list)
    for launched in run.launched.values():
        triggers[launched.shopper_id].append((launched.trigger_at, launched.version))
    landed: dict[str, list[tuple[float, tuple[int, int]]]] = defaultdict(list)
    for rid, stored in run.stored.items():
        if stored.kind == "insight":
            launched = run.launched[rid]
            landed[launched.shopper_id].append((stored.stored_at, launched.version))
    signal_at: dict[str, tuple[list[float], list[tuple[int, int]]]] = {}
    for shopper, writes in landed.items():
        writes.sort()
        times, newest, best = [], [], (-1, -1)
        for at, version in writes:
            best = max(best, version)  # the Redis sink keeps the newest version
            times.append(at)
            newest.append(best)
        signal_at[shopper] = (times, newest)
    for trigger_list in triggers.values():
        trigger_list.sort()
    ages = []
    for _ in range(samples):
        t = run.started + rng.uniform(0, run.seconds)
        for shopper, trigger_list in triggers.items():
            if trigger_list[0][0] > t:
                continue
            times, newest = signal_at.get(shopper, ([], []))
            i = bisect.bisect_right(times, t)
            signal = newest[i - 1] if i else (-1, -1)
            behind = [at for at, version in trigger_list if at <= t and version > signal]
            ages.append(t - min(behind) if behind else 0.0)
    return ages


STAGES = ("to_runner", "gate", "replica_ttft", "decode", "to_redis")
"""Where a landed insight's freshness (due -> Redis write) goes: due -> the runner hands the prompt to
the enricher (consumer lag, session step), the wait at the admission gate, request sent -> first token
(the wait at the replica for KV memory or a batch slot, and the prefill), first -> last token (decode),
answer -> stored (the answer ledger, the sinks)."""


def where_time_goes(run: Run) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per stage (``STAGES``), p50 / p99 / mean seconds over the landed insights, for purchase and cart
    together and for browse pauses."""
    stages: dict[str, dict[str, list[float]]] = {
        group: {stage: [] for stage in STAGES} for group in ("purchase_cart", "browse_pause")
    }
    for rid, stored in run.stored.items():
        if stored.kind != "insight":
            continue
        launched = run.launched[rid]
        group = stages["browse_pause" if launched.reason == "browse_pause" else "purchase_cart"]
        answered_at = launched.launched_at + stored.enricher_ms / 1000
        group["to_runner"].append(launched.launched_at - launched.trigger_at)
        group["gate"].append(stored.admission_wait_ms / 1000)
        group["replica_ttft"].append(stored.ttft_ms / 1000)
        group["decode"].append(max(0.0, stored.latency_ms - stored.ttft_ms) / 1000)
        group["to_redis"].append(stored.stored_at - answered_at)
    return {
        group: {
            stage: {
                "p50": _p(values, 0.5),
                "p99": _p(values, 0.99),
                "mean": round(statistics.fmean(values), 2) if values else None,
            }
            for stage, values in by_stage.items()
        }
        for group, by_stage in stages.items()
    }


WINDOW_SLICES = 6
"""The window's p50 and p99 are also given per sixth of it (``slices_p50``, ``slices_p99``, by when the
prompt became due): whether the last third's p99 above the first's is a climb that goes on, a queue
filling once and holding, or a few late answers (a sixth holds about a hundred, so its p99 is about its
second worst)."""


def summarise(run: Run, age_samples: int, capacity_prompts_s: float | None) -> dict[str, Any]:
    end = run.started + run.seconds
    third = run.seconds / 3
    fresh: list[float] = []
    first, last = [], []
    slices: list[list[float]] = [[] for _ in range(WINDOW_SLICES)]
    by_kind: dict[str, dict[str, list[float]]] = {k: {"kafka": [], "due": [], "enricher": []} for k in KINDS}
    prefill = decode = 0
    for rid, stored in run.stored.items():
        if stored.kind != "insight":
            continue
        launched = run.launched[rid]
        age = stored.stored_at - launched.trigger_at
        fresh.append(age)
        at = int((launched.trigger_at - run.started) / run.seconds * WINDOW_SLICES)
        if 0 <= at < WINDOW_SLICES:
            slices[at].append(age)
        if launched.trigger_at < run.started + third:
            first.append(age)
        elif launched.trigger_at >= end - third:
            last.append(age)
        kind = by_kind[launched.reason]
        newest = run.sent.get(launched.newest_event_id or "")
        if newest is not None:
            kind["kafka"].append(stored.stored_at - newest)
        kind["due"].append(age)
        kind["enricher"].append(stored.enricher_ms / 1000)
        landed_prefill, landed_decode = stored.landed_tokens
        prefill += landed_prefill
        decode += landed_decode
    prefill += run.landed_after_window[0]
    decode += run.landed_after_window[1]
    acct = run.accounting
    insights = max(1, acct["insights"])
    where = where_time_goes(run)
    computed = run.engine.get("prefill_tokens_computed", 0) + run.engine.get("decode_tokens", 0)
    wasted = max(0.0, computed - prefill - decode)
    superseded = [s for s in run.stored.values() if s.kind == "superseded"]
    ages = sampled_ages(run, age_samples, random.Random(7))
    due_in_window = [launched for launched in run.launched.values() if launched.launched_at <= end]
    offered = len(due_in_window) / run.seconds
    return {
        "arm": run.arm,
        "rate": run.rate,
        "seconds": run.seconds,
        "events_sent": len(run.sent),
        "events_consumed": acct["consumed"],
        "prompts_per_event": acct["prompts"] / max(1, acct["consumed"]),
        "prompts_due_per_s": offered,
        "load_vs_capacity": None if not capacity_prompts_s else offered / capacity_prompts_s,
        "accounting": acct,
        "overload_counts": run.overload_counts,
        "superseded": {
            "queued": sum(1 for s in superseded if s.cause == "newer_prompt" and not s.cancelled_in_flight),
            "cancelled_in_flight": sum(1 for s in superseded if s.cancelled_in_flight),
            "stale": sum(1 for s in superseded if s.cause == "stale"),
            "stale_purchase_cart": sum(
                1
                for rid, s in run.stored.items()
                if s.cause == "stale" and run.launched[rid].reason != "browse_pause"
            ),
        },
        "freshness_s": {
            "landed": len(fresh),
            "p50": _p(fresh, 0.5),
            "p99": _p(fresh, 0.99),
            "first_third_p99": _p(first, 0.99),
            "last_third_p99": _p(last, 0.99),
            "slices_p50": [_p(values, 0.5) for values in slices],
            "slices_p99": [_p(values, 0.99) for values in slices],
        },
        "signal_age_s": {
            "samples": len(ages),
            "p50": _p(ages, 0.5),
            "p90": _p(ages, 0.9),
            "p99": _p(ages, 0.99),
            "mean": round(statistics.fmean(ages), 2) if ages else None,
            "share_behind": round(sum(1 for a in ages if a > 0) / len(ages), 3) if ages else None,
        },
        "by_kind": {
            kind: {
                "landed": len(values["due"]),
                "from_kafka_p50": _p(values["kafka"], 0.5),
                "from_kafka_p99": _p(values["kafka"], 0.99),
                "from_due_p50": _p(values["due"], 0.5),
                "from_due_p99": _p(values["due"], 0.99),
                "at_enricher_p99": _p(values["enricher"], 0.99),
            }
            for kind, values in by_kind.items()
        },
        "tokens": {
            "engine": run.engine,
            "landed_prefill": prefill,
            "landed_decode": decode,
            "prefill_per_insight": run.engine.get("prefill_tokens_computed", 0) / insights,
            "decode_per_insight": run.engine.get("decode_tokens", 0) / insights,
            "wasted_share": wasted / computed if computed else 0.0,
            "wasted_decode_share": max(0.0, run.engine.get("decode_tokens", 0) - decode) / computed
            if computed
            else 0.0,
            "aborted_requests": run.engine.get("aborted", 0),
        },
        "where_time_goes_s": where,
        "admission_limit_second_half": _p(
            [
                float(v)
                for t, v in getattr(run, "limit_trace", [])
                if run.started + run.seconds / 2 <= t <= end
            ],
            0.5,
        ),
        "drain_s": round(run.drain_s, 1),
        "runner_paused_times": run.paused_times,
        "load_average": run.load_average,
        "cores_busy": round(run.cores_busy, 2),
    }


# ---- capacity ----------------------------------------------------------------------------------------
def capacity_from(run: Run) -> dict[str, Any]:
    """Requests the replicas finished per second over the second half of the probe's window, and the
    prompts the stream makes per event."""
    mid, end = run.started + run.seconds / 2, run.started + run.seconds
    window = [(t, served) for t, served in run.served_trace if mid <= t <= end]
    if len(window) < 2:
        raise RuntimeError("the probe is too short to measure capacity: raise --probe-seconds")
    (t0, s0), (t1, s1) = window[0], window[-1]
    prompts_s = (s1 - s0) / (t1 - t0)
    due_s = sum(1 for x in run.launched.values() if x.launched_at <= end) / run.seconds
    saturated = due_s >= prompts_s * 1.2 or run.paused_times > 0
    if not saturated:
        print(
            f"WARNING: the probe offered {due_s:.1f} prompts/s for {prompts_s:.1f} answered and the runner "
            "never paused its partitions: not saturated, so not the capacity; raise --probe-shoppers",
            flush=True,
        )
    return {
        "prompts_per_s": prompts_s,
        "probe_events_per_s": run.rate,
        "probe_seconds": run.seconds,
        "probe_prompts_due_per_s": due_s,
        "probe_runner_paused_times": run.paused_times,
        "saturated": saturated,
    }


def arm_settings(arm: str) -> OverloadSettings:
    """An arm is a policy, optionally with settings changed: ``POLICY/KEY=VALUE/...``, a KEY being an
    ``OverloadSettings`` field or a nested one (``adaptive.enabled=false``), a VALUE JSON or a string
    (``latest_wins_priority/max_in_flight=192``, ``latest_wins_priority/cancel_in_flight=false``)."""
    policy, *changes = arm.split("/")
    data: dict[str, Any] = {"policy": policy}
    for change in changes:
        key, _, text = change.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        *outer, last = key.split(".")
        target = data
        for name in outer:
            target = target.setdefault(name, {})
        target[last] = value
    return OverloadSettings.model_validate(data)


# ---- the report ----------------------------------------------------------------------------------------
def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _unaccounted_cell(accounting: dict[str, int]) -> str:
    """The runner counts prompts without a result; the Flink job's run counts events no result names."""
    if "prompts_unaccounted" in accounting:
        return str(accounting["prompts_unaccounted"])
    return f"{accounting['events_unnamed']} events"


def _rate_cell(row: dict[str, Any]) -> str:
    load = row["load_vs_capacity"]
    return f"{row['multiple']:g}x ({row['rate']:.0f}/s; {'-' if load is None else f'{load:.1f}'})"


def tables(rows: list[dict[str, Any]]) -> str:
    main = []
    for r in rows:
        f, a, t, s, k = r["freshness_s"], r["signal_age_s"], r["tokens"], r["superseded"], r["by_kind"]
        urgent = max((k[x]["from_due_p99"] or 0.0) for x in ("purchase", "add_to_cart"))
        main.append(
            [
                r["arm"],
                _rate_cell(r),
                r["accounting"]["prompts"],
                r["accounting"]["insights"],
                f"{s['queued']} / {s['cancelled_in_flight']} / {s['stale']}"
                + (f" ({s['stale_purchase_cart']})" if s.get("stale_purchase_cart") else ""),
                r["accounting"]["errors"],
                _unaccounted_cell(r["accounting"]),
                f"{_s(f['p50'])} / {_s(f['p99'])}",
                f"{_s(f['first_third_p99'])} → {_s(f['last_third_p99'])}",
                f"{_s(a['p50'])} / {_s(a['p99'])}",
                _s(urgent),
                _s(k["browse_pause"]["from_due_p99"]),
                f"{t['prefill_per_insight']:,.0f} + {t['decode_per_insight']:,.0f}",
                f"{t['wasted_share']:.1%} ({t.get('wasted_decode_share', 0.0):.1%})",
            ]
        )
    first = print_table(
        [
            "arm",
            "rate (events/s; load)",
            "prompts",
            "insights",
            "superseded queued / cancelled / stale (of them purchase+cart)",
            "errors",
            "unaccounted",
            "freshness p50 / p99 s",
            "p99 first → last third s",
            "signal age p50 / p99 s",
            "purchase+cart p99 from due s",
            "browse p99 from due s",
            "tokens per insight prefill + decode",
            "wasted tokens (decode)",
        ],
        main,
    )
    kinds = []
    for r in rows:
        for kind, v in r["by_kind"].items():
            kinds.append(
                [
                    r["arm"],
                    f"{r['multiple']:g}x",
                    kind,
                    v["landed"],
                    f"{_s(v['from_kafka_p50'])} / {_s(v['from_kafka_p99'])}",
                    f"{_s(v['from_due_p50'])} / {_s(v['from_due_p99'])}",
                ]
            )
    second = print_table(
        [
            "arm",
            "rate",
            "trigger",
            "landed",
            "from newest event's Kafka ts p50 / p99 s",
            "from due p50 / p99 s",
        ],
        kinds,
    )
    where_rows = []
    for r in rows:
        for group, by_stage in r.get("where_time_goes_s", {}).items():
            if by_stage["gate"]["p50"] is None:
                continue
            where_rows.append(
                [r["arm"], f"{r['multiple']:g}x", {"purchase_cart": "purchase+cart"}.get(group, group)]
                + [f"{_s(by_stage[st]['mean'])} / {_s(by_stage[st]['p99'])}" for st in STAGES]
            )
    third = (
        print_table(
            ["arm", "rate", "trigger", *(f"{st.replace('_', ' ')} mean / p99 s" for st in STAGES)], where_rows
        )
        if where_rows
        else ""
    )
    return f"{first}\n\n{second}" + (f"\n\n{third}" if third else "")


def targets(rows: list[dict[str, Any]], target_s: float) -> list[str]:
    """The overload targets at 1x and 2x, each arm against them (met / not met, with the numbers)."""
    at = {(r["arm"], r["multiple"]): r for r in rows}
    lines = []
    fifo_1x = at.get(("fifo", 1.0))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        one, two = at.get((arm, 1.0)), at.get((arm, 2.0))
        parts = []
        if one and two and one["freshness_s"]["p99"] and two["freshness_s"]["p99"]:
            ratio = two["freshness_s"]["p99"] / one["freshness_s"]["p99"]
            f2 = two["freshness_s"]
            if f2["last_third_p99"] is None:  # nothing landed late in the window: worse than growing
                growth_cell = "no signal landed in the last third (NOT met)"
            else:
                growth = f2["last_third_p99"] / max(1e-9, f2["first_third_p99"] or 0)
                verdict = "not growing" if growth <= GROWTH_LIMIT else "GROWING"
                growth_cell = f"{growth:.2f} ({verdict}, ≤ {GROWTH_LIMIT})"
            parts.append(
                f"2x p99 ÷ 1x p99 = {ratio:.2f} ({'met' if ratio <= 1.5 else 'NOT met'}, ≤ 1.5); "
                f"2x p99 last ÷ first third = {growth_cell}"
            )
        worst = max(r["tokens"]["wasted_share"] for r in rows if r["arm"] == arm)
        parts.append(f"wasted tokens at most {worst:.1%} ({'met' if worst <= 0.05 else 'NOT met'}, ≤ 5%)")
        if one and fifo_1x:
            mine = one["tokens"]["prefill_per_insight"] + one["tokens"]["decode_per_insight"]
            base = fifo_1x["tokens"]["prefill_per_insight"] + fifo_1x["tokens"]["decode_per_insight"]
            parts.append(
                f"tokens per insight at 1x {mine:,.0f} vs fifo {base:,.0f} "
                f"({'met' if mine <= base * 1.02 else 'NOT met'}, ≤ fifo within 2%)"
            )
        urgent = [
            (m, r["by_kind"][k]["from_due_p99"])
            for (a, m), r in at.items()
            if a == arm and m in (1.0, 2.0)
            for k in ("purchase", "add_to_cart")
        ]
        if urgent:
            worst_s = max(v or 0.0 for _, v in urgent)
            parts.append(
                f"purchase/cart p99 from due at 1x and 2x at most {worst_s:.1f} s "
                f"({'met' if worst_s <= target_s else 'NOT met'}, ≤ {target_s:g} s)"
            )
        lines.append(f"- `{arm}`: " + "; ".join(parts))
    return lines


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    arms = args.arms.split(",")
    for arm in arms:
        arm_settings(arm)  # a typo fails before the stack starts
    multiples = [float(m) for m in args.rates.split(",")]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    options: dict[str, Any] = {"shipped": {}, "none": {"replica_options": None}}.get(
        args.replica_options, {"replica_options": Path(args.replica_options)}
    )
    replica_settings = fleet_settings(options.get("replica_options", AGGREGATED_YAML))
    fleet = {"shipped": "serving/trtllm/aggregated.yaml", "none": "trtllm-serve defaults"}.get(
        args.replica_options, args.replica_options
    )
    if args.context_replicas:
        options["context_replicas"] = args.context_replicas
        fleet = (
            f"P/D: {args.context_replicas} context + {args.replicas - args.context_replicas} generation "
            "(serving/trtllm/disagg)"
        )
        replica_settings = {"disaggregated": fleet}
    simulator_env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("SIM_")]
    fleet = " + ".join([fleet, *simulator_env])
    with temporary_stack(replicas=args.replicas, time_scale=1.0, **options) as state:
        if args.capacity:
            capacity: dict[str, Any] = {"prompts_per_s": args.capacity, "given": True}
        else:
            print(
                f"capacity probe: {args.probe_shoppers} shoppers ({args.probe_shoppers * args.per_shopper:g} "
                f"events/s) for {args.probe_seconds:g} s",
                flush=True,
            )
            probe_policy = OverloadSettings(policy="latest_wins", cancel_in_flight=False)
            probe = await run_once(
                state,
                probe_policy,
                args.probe_shoppers * args.per_shopper,
                args.probe_seconds,
                shoppers=args.probe_shoppers,
                seed=args.seed + 100,
                grace_s=0,
                label="probe",
            )
            capacity = capacity_from(probe)
        print(f"capacity: {json.dumps(capacity)}", flush=True)
        with flink_cluster(args.engine == "flink") as cluster:
            rows = await runs(state, cluster, args, arms, multiples, capacity)
    result = {
        "machine": machine(),
        "engine": args.engine + (" (prompts topic)" if args.prompts_topic else ""),
        # The replicas inherit SIM_* settings, which win over the options file: part of the command.
        "command": " ".join([*simulator_env, "python -m bench.overload", *args.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "argv"},
        "capacity": capacity,
        "fleet": fleet,
        "replica_settings": replica_settings,
        "freshness_target_s": OverloadSettings().freshness_target_s,
        "rows": rows,
    }
    return report(result)


DERIVED = {"extra_llm_api_options", "cache_capacity_blocks", "max_seq_len"}
"""Simulator settings a replica fills from the others (the file, the GPU's memory, the model)."""


def fleet_settings(options: Path | None) -> dict[str, Any]:
    """The simulator settings the replicas run with besides their defaults, read as a replica reads
    them (the options file, then the ``SIM_*`` variables they inherit), so a results file says what it
    measured."""
    config = SimulatorConfig(extra_llm_api_options=options)
    settings: dict[str, Any] = config.model_dump(mode="json", exclude_defaults=True, exclude=DERIVED)
    return settings


@contextmanager
def flink_cluster(wanted: bool) -> Iterator[tuple[Path, Any] | None]:
    """A local Flink cluster of one TaskManager (the job at parallelism 1) for the Flink runs."""
    if not wanted:
        yield None
        return
    from devstack.flink_cluster import FlinkClusterSettings, cluster_down, cluster_up

    flink_dir = Path(tempfile.mkdtemp(prefix="bench-overload-flink-"))
    cluster = cluster_up(flink_dir, FlinkClusterSettings(taskmanagers=1))
    try:
        yield flink_dir, cluster
    finally:
        cluster_down(flink_dir)


async def runs(
    state: StackState,
    cluster: tuple[Path, Any] | None,
    args: argparse.Namespace,
    arms: list[str],
    multiples: list[float],
    capacity: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every arm at every multiple of the capacity, on the runner or (``cluster``) the Flink job."""
    rows = []
    for multiple in multiples:
        target = capacity["prompts_per_s"] * multiple
        shoppers = await asyncio.to_thread(shoppers_for, target, args.per_shopper, args.seconds, args.seed)
        rate = shoppers * args.per_shopper
        for arm in arms:
            label = f"{arm}@{multiple:g}x"
            print(
                f"run {label}: {rate:.1f} events/s of {shoppers} shoppers for {args.seconds:g} s",
                flush=True,
            )
            policy = arm_settings(arm)
            if args.per_replica_in_flight is not None:
                policy.per_replica_in_flight = args.per_replica_in_flight
            if cluster is not None:
                run = await asyncio.to_thread(
                    run_once_flink,
                    state,
                    *cluster,
                    policy,
                    rate,
                    args.seconds,
                    shoppers=shoppers,
                    seed=args.seed,
                    grace_s=args.grace,
                    label=label,
                    via_prompts_topic=args.prompts_topic,
                )
            else:
                run = await run_once(
                    state,
                    policy,
                    rate,
                    args.seconds,
                    shoppers=shoppers,
                    seed=args.seed,
                    grace_s=args.grace,
                    label=label,
                    consume_all_s=args.consume_all,
                    max_in_flight_prompts=None if policy.policy == "fifo" else args.max_in_flight_prompts,
                )
            if args.raw_dir is not None:
                args.raw_dir.mkdir(parents=True, exist_ok=True)
                (args.raw_dir / f"{label.replace('/', '+')}.pickle").write_bytes(pickle.dumps(run))
            row = summarise(run, args.age_samples, capacity["prompts_per_s"])
            row.update(arm=arm, multiple=multiple, shoppers=shoppers, target_prompts_per_s=target)
            rows.append(row)
            brief = {k: row[k] for k in ("accounting", "freshness_s", "prompts_due_per_s")}
            print(f"  {label}: {json.dumps(brief)}", flush=True)
    return rows


def report(result: dict[str, Any]) -> dict[str, Any]:
    """The tables and the targets' verdicts, from the rows (``--retable`` redoes them from a results file)."""
    rows = result["rows"]
    table = tables(rows)
    verdicts = targets(rows, result["freshness_target_s"])
    print("\n".join(verdicts))
    result["targets"] = verdicts
    result["table"] = table + "\n\nTargets:\n\n" + "\n".join(verdicts)
    return result


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="production window of each run")
    parser.add_argument("--rates", default="1,2,3", help="multiples of the measured capacity")
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="overload policies, comma-separated; POLICY/KEY=VALUE changes a setting (arm_settings)",
    )
    parser.add_argument(
        "--per-shopper",
        type=float,
        default=0.1,
        help="events/s of one shopper on average (Zipf-skewed): a rate is more shoppers, not faster ones",
    )
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument(
        "--engine",
        choices=("runner", "flink"),
        default="runner",
        help="the stream job driven: the embedded runner, or the Flink job on a local cluster (the "
        "capacity probe always runs the runner: it measures the fleet)",
    )
    parser.add_argument(
        "--prompts-topic",
        action="store_true",
        help="with --engine flink: the job ends at its session stage (prompts_topic) and a runner with "
        "input 'prompts' enriches what it sends there",
    )
    parser.add_argument(
        "--replica-options",
        default="shipped",
        help="the trtllm-serve options file the simulated replicas run with; 'shipped' (the stack's "
        "default): serving/trtllm/aggregated.yaml; 'none': trtllm-serve's own defaults (no chunked prefill)",
    )
    parser.add_argument(
        "--context-replicas",
        type=int,
        default=0,
        help="P/D disaggregation: this many of --replicas are context servers, the rest generation "
        "servers, on serving/trtllm/disagg's options, behind a gateway routing with pd_aware",
    )
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds after production before the stop")
    parser.add_argument("--age-samples", type=int, default=200, help="random instants for the signal age")
    parser.add_argument(
        "--probe-shoppers", type=int, default=4000, help="shoppers of the capacity probe (well past 1x)"
    )
    parser.add_argument("--probe-seconds", type=float, default=120.0, help="capacity: its second half")
    parser.add_argument(
        "--capacity", type=float, default=None, help="the fleet's prompts/s (1x); skips the probe"
    )
    parser.add_argument(
        "--per-replica-in-flight",
        type=int,
        default=None,
        help="the latest-wins arms' per_replica_in_flight (pipeline.overload: the adaptive limit's ceiling)",
    )
    parser.add_argument(
        "--max-in-flight-prompts",
        type=int,
        default=None,
        help="the latest-wins arms' runner backpressure limit (prompts waiting or running)",
    )
    parser.add_argument(
        "--consume-all",
        type=float,
        default=0.0,
        help="after production, wait up to this many seconds for the runner to read every event sent",
    )
    parser.add_argument(
        "--raw-dir", type=Path, default=None, help="also keep each run's records here (pickles)"
    )
    parser.add_argument("--out", default="overload.json", help="results file under bench/results")
    parser.add_argument(
        "--retable",
        type=Path,
        default=None,
        help="redo this results file's tables from its rows; no run",
    )
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.prompts_topic and args.engine != "flink":
        parser.error("--prompts-topic needs --engine flink (the runner has no prompts topic to end at)")
    args.argv = raw
    if args.retable is not None:
        args.retable.write_text(json.dumps(report(json.loads(args.retable.read_text())), indent=1))
        return
    result = asyncio.run(bench(args))
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / args.out).write_text(json.dumps(result, indent=1, default=_jsonable))


def _jsonable(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[call-overload]
    raise TypeError(f"not JSON: {type(value)}")


if __name__ == "__main__":
    main()
