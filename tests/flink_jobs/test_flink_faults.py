"""The fault suite's Flink case: the job on the standalone cluster (``flink run``, over Tansu) while its
Redis is SIGKILLed for 10 s mid-stream and restarted, ending in the same reader's accounting as the
embedded runner's cases (``tests.fault_kit``) and printing the same figures.

    pytest -m faults -s tests/flink_jobs/test_flink_faults.py

What the job is expected to do: ``WriteResults`` completes a call only once its result is stored in
Redis and S3, and its writes wait out the outage under ``sink_retry`` (the runner's policy); a
checkpoint cannot complete while a result is waiting (the Python bundle drains before the barrier), so
no offset is committed past a result that is not stored. A write that gave up would fail the job and
Flink would restart it from its last checkpoint (the second case makes that happen: its writes give
up after 3 s). Either way, at the end every event is processed or dead-lettered, the insights topic
read with ``read_committed`` holds exactly one record per prompt, S3 holds every prompt's result, and
no Redis signal ever went back (sampled through the whole run).

The stream arrives in three parts: before the outage (the job is storing results when Redis dies),
during it (events keep arriving; their results must wait), and after it. Time to recover is measured
from Redis answering again to the first signal written after it (sampled from Redis every 50 ms),
before the last part is produced: that write is a result that waited through the outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.sink_retry import SinkRetry
from shopper.readback import list_s3_records
from tests.conftest import SIM_TIME_SCALE, Isolated
from tests.fault_kit import (
    FaultFigures,
    FaultTable,
    OwnRedis,
    OwnReplicas,
    SignalWatcher,
    assert_fully_accounted,
    read_back,
    redis_signal_seqs,
    stopping,
)
from tests.flink_kit import (
    async_stage_job_settings,
    drain,
    flink_topics,
    produce,
    read_all,
    request_ids,
    run_job,
    wait_committed,
)
from tests.helpers import expected_prompts

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.flink]

OUTAGE_S = 10.0
PARTS = (150, 120, 90)
"""Events before, during and after the outage: a few hundred in all, so the case stays modest."""


@pytest.fixture(scope="module")
def fault_table() -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    print("\n\nflink fault case:")
    print(table.render(), flush=True)


class FirstWriteAfter:
    """Samples the Redis signals every 50 ms from ``start()`` and notes when they first differ from
    ``held``, what Redis held at the kill: the first result the job stored after the outage. The
    append-only file is fsynced on every write, so that is what Redis holds when it comes back. Read
    after the restart instead, the baseline raced the job: a write of every waiting result in the
    moment between the port opening and the first read made it the baseline, and nothing changed after
    it (the likely cause of one CI failure, "no result that waited through the outage was stored
    after it", not reproduced in two runs of the test alone)."""

    def __init__(self, redis_url: str, prefix: str, held: dict[str, int]) -> None:
        self.redis_url, self.prefix, self.held = redis_url, prefix, held
        self.restored_at = 0.0
        self.first_write_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-write", daemon=True)

    def start(self) -> None:
        self.restored_at = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            if redis_signal_seqs(self.redis_url, self.prefix) != self.held:
                self.first_write_at = time.monotonic()
                return

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=10)
        return None if self.first_write_at is None else self.first_write_at - self.restored_at


@pytest.mark.parametrize(
    "give_up_s",
    [None, 3.0],
    ids=["writes-wait-it-out", "writes-give-up-job-restarts"],
)
def test_flink_job_redis_stopped_for_10_s_mid_stream(
    give_up_s: float | None,
    isolated: Isolated,
    stack: StackState,
    stack_dir: Path,
    tmp_path: Path,
    flink_cluster: FlinkClusterState,
    fault_table: FaultTable,
    broker_hides_aborted: bool,
) -> None:
    stream = SyntheticStream(shoppers=16, seed=91, malformed_rate=0.02).take(sum(PARTS))
    before, during, after = (
        stream[: PARTS[0]],
        stream[PARTS[0] : PARTS[0] + PARTS[1]],
        stream[PARTS[0] + PARTS[1] :],
    )
    expected = expected_prompts(stream)
    redis = OwnRedis(tmp_path)
    with stopping(redis):
        redis.start()
        topics = flink_topics(isolated)
        prefix, s3_prefix = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
        settings = async_stage_job_settings(
            stack, stack_dir, isolated, topics, prefix=prefix, s3_prefix=s3_prefix
        )
        sinks = settings.sinks.model_copy(update={"redis_url": redis.url})
        settings = settings.model_copy(update={"sinks": sinks})
        if give_up_s is not None:  # the other path: a write gives up, Flink restarts from a checkpoint
            settings = settings.model_copy(update={"sink_retry": SinkRetry(max_wait_s=give_up_s)})
        assert (settings.sink_retry.max_wait_s > OUTAGE_S) == (give_up_s is None)
        rest = FlinkRest(flink_cluster.web_url)
        ends: dict[int, int] = {}

        def send(part: list[tuple[bytes, bytes, bool]]) -> None:
            for p, end in produce(stack.kafka_bootstrap, topics.events, [(k, v) for k, v, _ in part]).items():
                ends[p] = max(ends.get(p, 0), end)

        with SignalWatcher(redis.url, prefix) as watcher:
            send(before)
            job = run_job(flink_cluster, settings, stack_dir)
            deadline = time.monotonic() + 240
            while rest.completed_checkpoints(job.job_id) < 1 or len(watcher.highest) < 3:
                assert time.monotonic() < deadline, "the job stored no results"
                assert rest.job_state(job.job_id) == "RUNNING"
                time.sleep(0.3)
            held = redis_signal_seqs(redis.url, prefix)
            redis.kill()  # at once: a write between the read and the kill would count as after
            killed_at = time.monotonic()
            checkpoints_at_kill = rest.completed_checkpoints(job.job_id)
            send(during)  # the stream goes on arriving while Redis is away
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))
            checkpoints_in_outage = rest.completed_checkpoints(job.job_id) - checkpoints_at_kill
            state_in_outage = rest.job_state(job.job_id)
            redis.start()
            recovery = FirstWriteAfter(redis.url, prefix, held)
            recovery.start()
            # No new input until a result is stored: what is written now waited through the outage.
            deadline = time.monotonic() + 150
            while recovery.first_write_at is None and time.monotonic() < deadline:
                assert rest.job_state(job.job_id) in {"RUNNING", "RESTARTING", "INITIALIZING", "CREATED"}
                time.sleep(0.1)
            recover_s = recovery.stop()
            assert recover_s is not None, "no result that waited through the outage was stored after it"
            send(after)
            wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
            drain(flink_cluster, job.job_id, stack_dir)
        restarts = len(rest.get(f"/jobs/{job.job_id}/exceptions")["exceptionHistory"]["entries"])

        malformed = sum(m for *_, m in stream)
        view = read_back(
            bootstrap=stack.kafka_bootstrap,
            dlq_topic=topics.dlq,
            sinks=sinks,
            redis_prefix=prefix,
            s3_prefix=s3_prefix,
            expected=expected,
            malformed=malformed,
        )
        insights = request_ids(read_all(stack.kafka_bootstrap, topics.insights, expect=len(expected)))
    insight_duplicates = len(insights) - len(set(insights))
    notes = [f"job restarts {restarts}", f"checkpoints completed in the outage {checkpoints_in_outage}"]
    if malformed != len(view.dlq_positions):
        notes.append(f"{malformed} malformed")
    fault_table.add(
        FaultFigures(
            fault="Flink job (standalone cluster): Redis SIGKILLed for 10 s (AOF), restarted"
            + ("" if give_up_s is None else f"; writes give up after {give_up_s:.0f} s"),
            events_in=len(stream),
            processed=len(stream) - len(view.dlq_positions) - view.lost,
            dead_lettered=len(view.dlq_positions),
            lost=view.lost,
            reader_duplicates=view.duplicates + insight_duplicates,
            recover_s=recover_s,
            notes="; ".join(notes),
        )
    )
    print(f"job state at the end of the outage: {state_in_outage}", flush=True)
    assert not watcher.regressions, f"Redis signals went back in time: {watcher.regressions[:5]}"
    assert_fully_accounted(view)
    if give_up_s is not None:
        assert restarts > 0, "a write that gave up must fail the job into a restart"
    if broker_hides_aborted or restarts == 0:
        assert sorted(insights) == sorted(expected), "insights topic: not exactly one record per prompt"
    else:  # Tansu serves read_committed readers the records of the transactions a restart aborted
        assert set(insights) == set(expected), "insights topic: prompts missing or unexpected"


def test_flink_job_one_replica_of_two_sends_bad_answers(
    isolated: Isolated,
    stack: StackState,
    stack_dir: Path,
    tmp_path: Path,
    flink_cluster: FlinkClusterState,
    fault_table: FaultTable,
) -> None:
    """The runner's misbehaving-replica case on the Flink job: one replica answers every request with a
    200 that is no answer (a mix of every kind) beside one healthy one, on a backlog (the first part is
    produced before the job starts), so many calls are in flight to it before its quarantine. The job
    keeps running, every event and prompt is accounted for, at most 1% of prompts become error records,
    and the bad replica is quarantined (its reason in the TaskManager log): once it is, it gets nothing
    but probes.

    The stream comes in two parts: the first until the quarantine is in the log (the job's async stage
    may have many calls in flight to the replica before its third bad answer comes back, so what it
    got *before* the quarantine depends on the machine), the second after it."""
    stream = SyntheticStream(shoppers=24, seed=97, malformed_rate=0.02).take(480)
    first, second = stream[:160], stream[160:]
    expected = expected_prompts(stream)
    replicas = OwnReplicas(tmp_path, count=2, time_scale=SIM_TIME_SCALE, extra={0: ["--bad-answer", "mixed"]})
    with stopping(replicas):
        replicas.start()
        topics = flink_topics(isolated)
        prefix, s3_prefix = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
        settings = async_stage_job_settings(
            stack, stack_dir, isolated, topics, prefix=prefix, s3_prefix=s3_prefix
        )
        llm = settings.llm.model_copy(update={"endpoints": replicas.endpoints, "policy": "prefix_aware"})
        settings = settings.model_copy(update={"llm": llm})
        rest = FlinkRest(flink_cluster.web_url)
        logs_before = {p: p.stat().st_size for p in flink_cluster.log_dir.glob("*taskexecutor*.log")}

        def quarantine_lines() -> list[str]:
            text = "".join(
                p.read_bytes()[logs_before.get(p, 0) :].decode("utf-8", "replace")
                for p in flink_cluster.log_dir.glob("*taskexecutor*.log")
            )
            return [line for line in text.splitlines() if "quarantining replica" in line]

        ends = produce(stack.kafka_bootstrap, topics.events, [(k, v) for k, v, _ in first])
        job = run_job(flink_cluster, settings, stack_dir)
        wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
        deadline = time.monotonic() + 60
        while not quarantine_lines():
            assert time.monotonic() < deadline, "the bad replica was never quarantined"
            time.sleep(0.5)
        bad_before = replicas.bad_answers_sent(0)
        quarantined_at = time.monotonic()
        for p, end in produce(stack.kafka_bootstrap, topics.events, [(k, v) for k, v, _ in second]).items():
            ends[p] = max(ends.get(p, 0), end)
        wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
        drain(flink_cluster, job.job_id, stack_dir)
        after_quarantine_s = time.monotonic() - quarantined_at
        bad_after = replicas.bad_answers_sent(0) - bad_before
        restarts = len(rest.get(f"/jobs/{job.job_id}/exceptions")["exceptionHistory"]["entries"])
        quarantines = quarantine_lines()
    view = read_back(
        bootstrap=stack.kafka_bootstrap,
        dlq_topic=topics.dlq,
        sinks=settings.sinks,
        redis_prefix=prefix,
        s3_prefix=s3_prefix,
        expected=expected,
        malformed=sum(m for *_, m in stream),
    )
    errors = sum(
        1
        for record in list_s3_records(settings.sinks, s3_prefix)[1]
        if record.get("kind") == "error" or "error_type" in record
    )
    # after the quarantine only probes reach the replica: one per cool-down (each probe fails here)
    probes = 1 + int(after_quarantine_s / settings.llm.answer_health.cooldown_s)
    fault_table.add(
        FaultFigures(
            fault=f"Flink job: one replica of 2 sends bad answers (mixed): {bad_before} bad answers before "
            f"its quarantine, {bad_after} in the {after_quarantine_s:.0f} s after it, {errors} error records",
            events_in=len(stream),
            processed=len(stream) - len(view.dlq_positions) - view.lost,
            dead_lettered=len(view.dlq_positions),
            lost=view.lost,
            reader_duplicates=view.duplicates,
            recover_s=None,
            notes=f"job restarts {restarts}",
        )
    )
    print(f"\nquarantine log lines: {quarantines[:2]}", flush=True)
    assert_fully_accounted(view)
    assert restarts == 0, "a bad answer must never fail the job"
    assert errors <= 0.01 * len(expected), f"{errors} error records of {len(expected)} prompts"
    assert bad_after <= probes, (
        f"after its quarantine the bad replica got {bad_after} requests, probes {probes}"
    )
    assert "bad answers" in quarantines[0], "the quarantine and its reason are in the log"
