"""Recovery of the job on the standalone cluster from a lost TaskManager, under a steady paced stream.

    .venv/bin/python -m bench.flink_recovery [--rate 10] [--seconds 120] [--kill-after 40]

The job runs at its defaults (checkpoint interval, restart strategy) with the rate limit off, so each
``add_to_cart`` is a prompt at once; 1 record in 50 is malformed. ``kill_after`` s into the stream
(and after at least one completed checkpoint) the TaskManager's process group, the JVM and its Python
workers, is SIGKILLed, as a lost machine, and a new TaskManager is started at once (what
``tests/flink_jobs/test_flink_cluster.py`` does). Measured from the kill: when the JobManager recorded
the failure, when every task of the job is RUNNING again, and when the first new result is written to
Redis; the freshness (Redis write - event time, end to end) of the events produced between the kill and
that first result, against the steady state before the kill and after the recovery.

Accounting at the end, once the group's committed offsets cover every produced record: every valid
event is the newest event of some prompt whose result is in S3, every malformed record has a dead
letter (deduplicated on partition/offset: the DLQ is at-least-once), and the insights topic read with
``read_committed`` holds exactly one record per prompt.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from confluent_kafka import KafkaError, Message, Producer

from bench.common import load_average, machine, paced, percentile, print_table, write_results
from bench.flink_kit import (
    Knobs,
    SignalPoller,
    bench_job,
    cart_event,
    describe,
    parse_variant,
    wait_committed,
)
from devstack.flink_cluster import (
    FlinkClusterSettings,
    FlinkClusterState,
    FlinkRest,
    cluster_down,
    cluster_up,
    save_cluster,
    start_taskmanager,
    submit,
)
from devstack.processes import alive
from devstack.stack import StackSettings, StackState, stack_down, stack_up
from pipeline.dead_letter import DeadLetter
from shopper.readback import list_s3_records, read_topic

MALFORMED_EVERY = 50
STEADY_WARMUP_S = 15.0
SETTLE_S = 10.0
"""Events produced this long after the first new result count as 'after the recovery'."""
IN_FLIGHT_S = 5.0
"""Events produced this long before the kill may have been in flight (their results are written after
the recovery): their own row, not the steady state."""


@dataclass
class Stream:
    """What the producer thread wrote: per event (shopper, Kafka timestamp, valid), and per partition
    the offset after the last record (from the delivery reports)."""

    events: list[tuple[str, float, bool]] = field(default_factory=list)
    ends: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@dataclass
class Recovery:
    settings: str
    checkpoint_age_s: float
    noticed_s: float
    running_s: float
    first_result_s: float
    outage_events: int
    outage_observed: list[float]
    steady: list[float]
    in_flight: tuple[int, list[float]]
    after: list[float]
    produced: int
    malformed: int
    uncovered: int
    results: int
    result_errors: int
    s3_replayed: int
    dead_letters: int
    insights: int
    insight_duplicates: int
    insights_missing: int
    insights_extra: int
    duplicates_replayed: bool
    """Every duplicated insight is a result that was replayed after the kill (S3 written twice)."""


def produce_paced(
    bootstrap: str, topic: str, tag: str, rate: float, seconds: float, shoppers: int, out: Stream
) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})

    def delivered(error: KafkaError | None, message: Message) -> None:
        partition, offset = message.partition(), message.offset()
        if error is not None or partition is None or offset is None:
            out.failures.append(str(error))
            return
        out.ends[partition] = max(out.ends.get(partition, 0), offset + 1)

    for n in paced(rate, seconds):
        shopper = f"shopper-{n % shoppers:04d}"
        now = time.time()
        valid = n % MALFORMED_EVERY != MALFORMED_EVERY - 1
        value = cart_event(tag, n, shopper, now) if valid else b"{not json " + str(n).encode()
        producer.produce(
            topic, key=shopper.encode(), value=value, timestamp=int(now * 1000), on_delivery=delivered
        )
        producer.poll(0)
        out.events.append((shopper, now, valid))
    producer.flush(30)


def runs_python_workers(pgid: int) -> bool:
    """Whether process group ``pgid`` (a TaskManager: its restart loop, JVM and workers) has a Python
    worker in it: only a TaskManager that runs a subtask of the job starts one (``/proc``; Linux only)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or int(stat.parent.name) == pgid:
                continue
            program = (stat.parent / "cmdline").read_bytes().split(b"\0")[0]
            if b"python" in program.rsplit(b"/", 1)[-1]:  # not the JVM, whose classpath names flink-python
                return True
        except (OSError, ValueError):  # the process ended while we looked
            continue
    return False


def kill_taskmanager(cluster: FlinkClusterState, state_dir: Path) -> float:
    """SIGKILL the process group of the TaskManager that runs the job (the cluster has more than one;
    at parallelism 1 only one of them runs its subtasks) and start a new TaskManager in its place;
    returns the kill time."""
    live = [p for p in cluster.processes if p.name.startswith("flink-taskmanager") and alive(p.pid)]
    victims = [p for p in live if runs_python_workers(p.pid)] if len(live) > 1 else live
    if len(victims) != 1:
        raise RuntimeError(
            f"expected one TaskManager running the job, found {[v.name for v in victims]} of "
            f"{[v.name for v in live]}"
        )
    (victim,) = victims
    os.killpg(victim.pid, signal.SIGKILL)  # the JVM and its Python workers, like a lost machine
    killed = time.time()
    cluster.processes.remove(victim)
    start_taskmanager(cluster, name=f"{victim.name}-replaced")
    save_cluster(state_dir, cluster)
    return killed


def watch_restart(rest: FlinkRest, job_id: str, killed: float, timeout_s: float = 600.0) -> float:
    """Until the job has left all-tasks-RUNNING and come back to it; returns the time it is back."""
    deadline = time.monotonic() + timeout_s
    left = False
    while time.monotonic() < deadline:
        try:
            job = rest.get(f"/jobs/{job_id}")
        except OSError:
            time.sleep(0.2)
            continue
        if job["state"] in {"FAILED", "CANCELED", "FINISHED"}:
            raise RuntimeError(f"job {job_id} is {job['state']} after the kill")
        running = job["state"] == "RUNNING" and all(v["status"] == "RUNNING" for v in job["vertices"])
        restarted = any(int(v.get("start-time", -1)) > killed * 1000 for v in job["vertices"])
        if not running:
            left = True
        elif left or restarted:
            return time.time()
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} not running again {timeout_s} s after the kill")


def failure_noticed(rest: FlinkRest, job_id: str, killed: float) -> float:
    """The JobManager's timestamp of the first failure recorded after the kill."""
    entries = rest.get(f"/jobs/{job_id}/exceptions")["exceptionHistory"]["entries"]
    stamps = [int(e["timestamp"]) / 1000 for e in entries if int(e["timestamp"]) / 1000 >= killed - 1]
    return min(stamps) if stamps else float("nan")


def recovery(
    stack: StackState,
    state_dir: Path,
    knobs: Knobs,
    *,
    rate: float,
    seconds: float,
    kill_after: float,
) -> Recovery:
    tag = uuid.uuid4().hex[:8]
    settings = bench_job(stack, state_dir, tag, knobs, live=True)
    cluster = cluster_up(state_dir)
    rest = FlinkRest(cluster.web_url)
    job = submit(cluster, settings, config_path=state_dir / "flink" / f"bench-{tag}.json")
    rest.wait_running(job.job_id)
    stream = Stream()
    shoppers = max(1, int(rate * 30))  # each shopper acts every ~30 s: one event each in an outage
    producer = threading.Thread(
        target=produce_paced,
        args=(stack.kafka_bootstrap, settings.kafka.events_topic, tag, rate, seconds, shoppers, stream),
        daemon=True,
    )
    with SignalPoller(stack.redis_url, settings.sinks.redis_key_prefix, interval_s=0.1) as poller:
        started = time.time()
        producer.start()
        while time.time() - started < kill_after or rest.completed_checkpoints(job.job_id) < 1:
            time.sleep(0.2)
        last = rest.get(f"/jobs/{job.job_id}/checkpoints")["latest"]["completed"]
        killed = kill_taskmanager(cluster, state_dir)
        checkpoint_age = killed - int(last["trigger_timestamp"]) / 1000
        running = watch_restart(rest, job.job_id, killed)
        noticed = failure_noticed(rest, job.job_id, killed)
        producer.join()
        if stream.failures:
            raise RuntimeError(f"produce failed: {stream.failures[:3]}")
        wait_committed(
            stack.kafka_bootstrap, settings.kafka.group_id, settings.kafka.events_topic, stream.ends, 600
        )
        time.sleep(2)
    writes = sorted(w for w, _ in poller.seen.values() if w > killed)
    first_result = writes[0] if writes else float("nan")
    written_at = {round(event_ts, 6): written for written, event_ts in poller.seen.values()}

    def fresh(lo: float, hi: float) -> tuple[int, list[float]]:
        window = [ts for _, ts, valid in stream.events if valid and lo <= ts < hi]
        found = [(written_at[round(ts, 6)] - ts) * 1000 for ts in window if round(ts, 6) in written_at]
        return len(window), found

    outage_n, outage = fresh(killed, first_result)
    _, steady = fresh(started + STEADY_WARMUP_S, killed - IN_FLIGHT_S)
    in_flight = fresh(killed - IN_FLIGHT_S, killed)
    _, after = fresh(first_result + SETTLE_S, float("inf"))

    sinks = settings.sinks
    _, records = list_s3_records(sinks, sinks.s3_prefix)
    by_id = {str(r["request_id"]): r for r in records}
    covered = {(str(r["shopper_id"]), round(float(r["last_event_ts"]), 6)) for r in by_id.values()}
    valid_events = [(s, round(ts, 6)) for s, ts, valid in stream.events if valid]
    malformed = sum(1 for _, _, valid in stream.events if not valid)
    insights = [
        str(orjson.loads(v)["request_id"])
        for v in read_topic(
            stack.kafka_bootstrap, settings.insights_topic or "", expect=len(by_id), read_committed=True
        )
    ]
    dead = {
        (d.partition, d.offset)
        for d in (
            DeadLetter.from_bytes(v)
            for v in read_topic(
                stack.kafka_bootstrap, settings.kafka.dlq_topic, expect=malformed, read_committed=False
            )
        )
    }
    rest.cancel(job.job_id)
    seen_s3: set[str] = set()
    replayed: set[str] = set()
    for record in records:
        rid = str(record["request_id"])
        (replayed if rid in seen_s3 else seen_s3).add(rid)
    duplicated = {rid for rid in insights if insights.count(rid) > 1}
    return Recovery(
        settings=describe(settings),
        checkpoint_age_s=checkpoint_age,
        noticed_s=noticed - killed,
        running_s=running - killed,
        first_result_s=first_result - killed,
        outage_events=outage_n,
        outage_observed=outage,
        steady=steady,
        in_flight=in_flight,
        after=after,
        produced=len(stream.events),
        malformed=malformed,
        uncovered=sum(1 for e in valid_events if e not in covered),
        results=len(by_id),
        result_errors=sum(1 for r in by_id.values() if r.get("kind") == "error"),
        s3_replayed=len(records) - len(by_id),
        dead_letters=len(dead),
        insights=len(insights),
        insight_duplicates=len(insights) - len(set(insights)),
        insights_missing=len(set(by_id) - set(insights)),
        insights_extra=len(set(insights) - set(by_id)),
        duplicates_replayed=duplicated <= replayed,
    )


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 0.5):,.0f} / {percentile(values, 0.99):,.0f} / {max(values):,.0f}"


def print_recovery(r: Recovery) -> str:
    """Print the run's three tables and verdict lines; return them as one text (the results' table)."""
    cluster = FlinkClusterSettings()
    print(
        f"job: {r.settings}; restart exponential-delay from 1 s; cluster heartbeat "
        f"{cluster.heartbeat_interval_ms} ms, timeout {cluster.heartbeat_timeout_ms} ms"
    )
    parts = []
    parts.append(
        print_table(
            ["from the SIGKILL of the TaskManager", "seconds"],
            [
                ["last completed checkpoint was triggered (replayed window)", f"-{r.checkpoint_age_s:.1f}"],
                ["JobManager records the failure", f"{r.noticed_s:.1f}"],
                ["every task RUNNING again (new TaskManager)", f"{r.running_s:.1f}"],
                ["first new result written to Redis", f"{r.first_result_s:.1f}"],
            ],
        )
    )
    parts.append(
        print_table(
            ["events", "count", "freshness p50 / p99 / max ms (Redis write - event time)"],
            [
                [
                    f"steady, before the last {IN_FLIGHT_S:.0f} s before the kill",
                    len(r.steady),
                    _ms(r.steady),
                ],
                [f"produced in the {IN_FLIGHT_S:.0f} s before the kill", r.in_flight[0], _ms(r.in_flight[1])],
                [
                    "produced between the kill and the first new result",
                    r.outage_events,
                    _ms(r.outage_observed),
                ],
                [f"produced from {SETTLE_S:.0f} s after the first new result", len(r.after), _ms(r.after)],
            ],
        )
    )
    seen = f"(outage: {len(r.outage_observed)} of {r.outage_events} results seen by the Redis poller)"
    print(seen)
    parts[-1] += f"\n\n{seen}"
    parts.append(
        print_table(
            ["accounting", "count"],
            [
                ["records produced", r.produced],
                ["malformed", r.malformed],
                ["valid events in no stored prompt", r.uncovered],
                ["prompts with a result in S3", r.results],
                ["of them error results", r.result_errors],
                ["S3 records written twice (replay, deduped on request_id)", r.s3_replayed],
                ["dead letters (distinct partition/offset)", r.dead_letters],
                ["insights, read_committed", r.insights],
                [
                    "insights duplicated / missing / extra",
                    f"{r.insight_duplicates} / {r.insights_missing} / {r.insights_extra}",
                ],
            ],
        )
    )
    events_ok = r.uncovered == 0 and r.dead_letters == r.malformed
    insights_ok = r.insight_duplicates == r.insights_missing == r.insights_extra == 0
    verdicts = ["events: " + ("every one processed or dead-lettered" if events_ok else "INCOMPLETE")]
    if insights_ok:
        verdicts.append("insights: exactly one record per prompt under read_committed")
    elif r.insights_missing == r.insights_extra == 0 and r.duplicates_replayed:
        verdicts.append(
            "insights: none missing; every duplicate is a result replayed after the kill, i.e. a record "
            "of the transaction open at the kill, which the new TaskManager aborted (a broker that "
            "filters aborted transactions hides it from read_committed; see bench.tansu_fetch)"
        )
    else:
        verdicts.append("insights: INCOMPLETE")
    print("\n".join(verdicts))
    return "\n\n".join([*parts, "; ".join(verdicts) + "."])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="events/s, each one a prompt")
    parser.add_argument("--seconds", type=float, default=120.0, help="stream length")
    parser.add_argument("--kill-after", type=float, default=40.0, help="seconds into the stream")
    parser.add_argument("--variant", default="default", help="job knobs (bench.flink_kit.KNOBS)")
    parser.add_argument("--out", default="flink_recovery.json", help="results file name under bench/results")
    args = parser.parse_args()
    state_dir = Path(tempfile.mkdtemp(prefix="bench-flink-"))
    stack = stack_up(StackSettings(state_dir=state_dir, replicas=2, time_scale=0.01))
    try:
        loads = [load_average()]
        print(f"machine: {machine()}; Flink 2.3 standalone, Tansu, 2 simulator replicas (x0.01); {loads[0]}")
        knobs = parse_variant(args.variant)
        run = recovery(
            stack, state_dir, knobs, rate=args.rate, seconds=args.seconds, kill_after=args.kill_after
        )
        table = print_recovery(run)
        loads.append(load_average())
        print(loads[-1])
        write_results(
            args.out, {"args": vars(args), "job": run.settings, "load_averages": loads, "table": table}
        )
    finally:
        cluster_down(state_dir)
        stack_down(state_dir)


if __name__ == "__main__":
    main()
