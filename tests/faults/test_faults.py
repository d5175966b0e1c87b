"""The fault suite: the embedded runner against real parts that fail mid-stream, each case ending in the
reader's full accounting (``tests.fault_kit``) and printing its figures.

    pytest -m faults -s tests/faults/test_faults.py      # prints the table docs/reliability.md holds

Each case uses parts of its own where the fault needs one (a durable Tansu, a redis-server, a moto
server behind a proxy, simulator replicas) and the shared stack for everything else. Event counts are
small and the simulators time-scaled, so the suite stays a few minutes on two busy cores. No timing is
asserted: time to recover is measured and printed, never compared with a number.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.enrichment import EnrichmentSettings
from runner.embedded import EmbeddedRunner
from serving.simulator.bad_answers import BAD_ANSWERS
from sinks.config import SinkSettings
from tests.conftest import SIM_TIME_SCALE, Isolated
from tests.fault_kit import (
    DurableTansu,
    FaultFigures,
    FaultTable,
    OwnRedis,
    OwnReplicas,
    PacedProducer,
    ProxiedMoto,
    ReaderView,
    RecoveryClock,
    RunnerLog,
    SignalWatcher,
    assert_fully_accounted,
    read_back,
    stopping,
    wait_until,
)
from tests.helpers import expected_prompts, produce_records

pytestmark = [pytest.mark.faults, pytest.mark.slow]

EVENTS = 1200
RATE = 45.0
"""Events per second of the paced producer: the stream is still arriving through every outage, and
for a while after it (so recovery is measured on new work, not only on what waited)."""
LLM_RATE = 30.0
"""Slower for the 20 s LLM outage, for the same reason."""
OUTAGE_S = 10.0
LLM_OUTAGE_S = 20.0


@pytest.fixture(scope="module")
def fault_table() -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    print(f"\n\nfault suite ({os.cpu_count()} cores, simulator time scale {SIM_TIME_SCALE}):")
    print(table.render(), flush=True)
    target = os.environ.get("FAULTS_TABLE")
    if target:
        Path(target).write_text(table.render() + "\n")


@pytest.fixture
def runner_log(request: pytest.FixtureRequest) -> Iterator[RunnerLog]:
    """The runner's log lines of a case, printed with their times when the case fails
    (``tests/faults/conftest.py`` keeps each phase's report on the test item)."""
    log = RunnerLog()
    yield log
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"\n---- the runner's log ({len(log)} lines) ----\n{log.render()}", flush=True)


@pytest.fixture
def iso(stack: StackState) -> Iterator[Isolated]:
    """Names of one case; topics are created by the case (on the broker it uses)."""
    names = Isolated(stack)
    yield names
    names.cleanup()


def create_topics(bootstrap: str, iso: Isolated, partitions: int = 4) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(iso.topic, partitions, 1),
            NewTopic(iso.dlq_topic, 1, 1),
            NewTopic(iso.insights_topic, 1, 1),
        ]
    )
    for future in futures.values():
        future.result(timeout=30)


def stream(seed: int) -> list[tuple[bytes, bytes, bool]]:
    return SyntheticStream(shoppers=40, seed=seed, malformed_rate=0.01).take(EVENTS)


async def run_with_fault(
    runner: EmbeddedRunner,
    inject: Callable[[RecoveryClock], Coroutine[Any, Any, None]],
    *,
    progress: Literal["results", "commits"],
    timeout_s: float = 240,
) -> RecoveryClock:
    """Run ``runner`` to the end (``until_drained``) while ``inject`` breaks a part and brings it back
    (calling ``clock.restored()``); a runner that raises fails the case."""
    clock = RecoveryClock(runner, progress)
    task = asyncio.create_task(runner.run(), name="runner")
    watch = asyncio.create_task(clock.watch(), name="recovery-clock")
    injecting = asyncio.create_task(inject(clock), name="fault")
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.wait([injecting, task], return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not injecting.done():
                injecting.cancel()
                await task  # the runner failed (raises here) or ended before the fault
                raise AssertionError("the runner ended before the fault was over")
            await injecting
            await task
    finally:
        watch.cancel()
        injecting.cancel()
        if not task.done():
            runner.request_stop()
            task.cancel()
    return clock


def figures(
    fault: str, records: list[tuple[bytes, bytes, bool]], view: ReaderView, recover_s: float | None
) -> FaultFigures:
    malformed = sum(m for *_, m in records)
    return FaultFigures(
        fault=fault,
        events_in=len(records),
        processed=len(records) - len(view.dlq_positions) - view.lost,
        dead_lettered=len(view.dlq_positions),
        lost=view.lost,
        reader_duplicates=view.duplicates,
        recover_s=recover_s,
        notes=f"{malformed} malformed" if malformed != len(view.dlq_positions) else "",
    )


def settle(
    fault_table: FaultTable,
    fault: str,
    records: list[tuple[bytes, bytes, bool]],
    watcher: SignalWatcher,
    clock: RecoveryClock,
    *,
    bootstrap: str,
    sinks: SinkSettings,
    iso: Isolated,
) -> None:
    """The end of every case: read back what a reader sees (dead letters from ``bootstrap``, results
    from ``sinks``), add the case's row to the table and assert the full accounting."""
    view = read_back(
        bootstrap=bootstrap,
        dlq_topic=iso.dlq_topic,
        sinks=sinks,
        redis_prefix=iso.prefix,
        s3_prefix=iso.s3_prefix,
        expected=expected_prompts(records),
        malformed=sum(m for *_, m in records),
    )
    finish(fault_table, fault, records, view, watcher, clock.seconds)


def finish(
    fault_table: FaultTable,
    fault: str,
    records: list[tuple[bytes, bytes, bool]],
    view: ReaderView,
    watcher: SignalWatcher,
    recover_s: float | None,
) -> None:
    fault_table.add(figures(fault, records, view, recover_s))
    assert not watcher.regressions, f"Redis signals went back in time: {watcher.regressions[:5]}"
    assert_fully_accounted(view)


# ---- a. the broker ----------------------------------------------------------------------------------
def test_broker_killed_and_restarted_mid_stream(
    stack: StackState, iso: Isolated, tmp_path: Path, fault_table: FaultTable, runner_log: RunnerLog
) -> None:
    tansu = DurableTansu(tmp_path, stack, bucket=f"tansu-{iso.tag}")
    with stopping(tansu):
        tansu.start()
        create_topics(tansu.bootstrap, iso)
        records = stream(seed=71)
        produce_records(tansu.bootstrap, iso.topic, records)  # on durable storage before the kill
        # Small polls and few prompts in flight: the runner is still reading when the broker dies.
        settings = iso.runner(bootstrap_servers=tansu.bootstrap, batch_max_events=20, max_in_flight_prompts=4)
        runner = EmbeddedRunner(settings, log=runner_log)

        async def inject(clock: RecoveryClock) -> None:
            acct = runner.stats.accounting
            await wait_until(lambda: acct.consumed >= EVENTS // 4 and runner.stats.commits > 0, "progress")
            assert acct.consumed < EVENTS, "the kill must land mid-stream"
            await asyncio.to_thread(tansu.kill)
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(tansu.start)
            clock.restored()

        with SignalWatcher(stack.redis_url, iso.prefix) as watcher:
            clock = asyncio.run(run_with_fault(runner, inject, progress="commits"))
        assert runner.stats.accounting.balanced, runner_log[-10:]
        settle(
            fault_table,
            "Kafka broker SIGKILLed, restarted after 10 s",
            records,
            watcher,
            clock,
            bootstrap=tansu.bootstrap,
            sinks=iso.sinks(),
            iso=iso,
        )


# ---- b. Redis ---------------------------------------------------------------------------------------
def test_redis_stopped_for_10_s_mid_stream(
    stack: StackState, iso: Isolated, tmp_path: Path, fault_table: FaultTable, runner_log: RunnerLog
) -> None:
    redis = OwnRedis(tmp_path)
    with stopping(redis):
        redis.start()
        create_topics(stack.kafka_bootstrap, iso)
        records = stream(seed=72)
        sinks = iso.sinks().model_copy(update={"redis_url": redis.url})
        runner = EmbeddedRunner(iso.runner(sinks=sinks, drain_idle_s=3.0), log=runner_log)
        producer = PacedProducer(stack.kafka_bootstrap, iso.topic, records, RATE).start()
        committed_at_kill: list[int] = []

        async def inject(clock: RecoveryClock) -> None:
            await wait_until(lambda: runner.stats.accounting.insights >= 20, "results stored")
            await asyncio.to_thread(redis.kill)
            committed_at_kill.append(runner.stats.commits)
            await asyncio.sleep(OUTAGE_S)
            # As for S3: Redis stays away until a write has met the outage, whatever the machine's load.
            await wait_until(lambda: runner.stats.sink_retries > 0, "a Redis write meeting the outage", 200)
            await asyncio.to_thread(redis.start)
            clock.restored()

        with SignalWatcher(redis.url, iso.prefix) as watcher:
            clock = asyncio.run(run_with_fault(runner, inject, progress="results"))
        producer.join()
        assert runner.stats.sink_retries > 0, "the outage was met and waited out"
        assert runner.stats.accounting.balanced, runner_log[-10:]
        settle(
            fault_table,
            "Redis SIGKILLed for 10 s (AOF), restarted",
            records,
            watcher,
            clock,
            bootstrap=stack.kafka_bootstrap,
            sinks=sinks,
            iso=iso,
        )


# ---- c. S3 ------------------------------------------------------------------------------------------
def test_s3_endpoint_down_for_10_s_mid_stream(
    stack: StackState, iso: Isolated, tmp_path: Path, fault_table: FaultTable, runner_log: RunnerLog
) -> None:
    s3 = ProxiedMoto(tmp_path, bucket=f"faults-{iso.tag}")
    with stopping(s3):
        s3.start()
        create_topics(stack.kafka_bootstrap, iso)
        records = stream(seed=73)
        sinks = iso.sinks().model_copy(update={"s3_endpoint_url": s3.url, "s3_bucket": s3.bucket})
        runner = EmbeddedRunner(iso.runner(sinks=sinks, drain_idle_s=3.0), log=runner_log)
        producer = PacedProducer(stack.kafka_bootstrap, iso.topic, records, RATE).start()

        async def inject(clock: RecoveryClock) -> None:
            await wait_until(lambda: runner.stats.commits >= 3, "commits")
            await asyncio.to_thread(s3.stop_proxy)
            await asyncio.sleep(OUTAGE_S)
            # On a loaded machine the window can pass with nothing to flush: keep S3 away until a write
            # has met the outage (at the latest the final drain's flush), so the case always tests it.
            await wait_until(lambda: runner.stats.sink_retries > 0, "an S3 write meeting the outage", 200)
            await asyncio.to_thread(s3.start_proxy)
            clock.restored()

        with SignalWatcher(stack.redis_url, iso.prefix) as watcher:
            clock = asyncio.run(run_with_fault(runner, inject, progress="commits"))
        producer.join()
        assert runner.stats.sink_retries > 0, "the outage was met and waited out"
        assert runner.stats.accounting.balanced, runner_log[-10:]
        settle(
            fault_table,
            "S3 endpoint down for 10 s",
            records,
            watcher,
            clock,
            bootstrap=stack.kafka_bootstrap,
            sinks=sinks,
            iso=iso,
        )


# ---- d. every LLM replica ---------------------------------------------------------------------------
def test_every_llm_replica_down_for_20_s(
    stack: StackState, iso: Isolated, tmp_path: Path, fault_table: FaultTable, runner_log: RunnerLog
) -> None:
    replicas = OwnReplicas(tmp_path, count=2, time_scale=SIM_TIME_SCALE)
    with stopping(replicas):
        replicas.start()
        create_topics(stack.kafka_bootstrap, iso)
        records = stream(seed=74)
        # A 12 s deadline: prompts caught early in the 20 s outage become error records, later ones
        # wait for the replicas and succeed. Both paths run.
        runner = EmbeddedRunner(
            iso.runner(
                llm=iso.llm(endpoints=replicas.endpoints),
                enrichment=EnrichmentSettings(deadline_s=12.0),
                drain_idle_s=3.0,
            ),
            log=runner_log,
        )
        producer = PacedProducer(stack.kafka_bootstrap, iso.topic, records, LLM_RATE).start()

        async def inject(clock: RecoveryClock) -> None:
            await wait_until(lambda: runner.stats.accounting.insights >= 20, "results stored")
            await asyncio.to_thread(replicas.kill)
            await asyncio.sleep(LLM_OUTAGE_S)
            await asyncio.to_thread(replicas.start)
            clock.restored()

        with SignalWatcher(stack.redis_url, iso.prefix) as watcher:
            clock = asyncio.run(run_with_fault(runner, inject, progress="results"))
        producer.join()
        acct = runner.stats.accounting
        assert acct.balanced, runner_log[-10:]
        error_types = Counter(line.split(": ")[1] for line in runner_log if line.startswith("error record "))
        print(f"\nerror records by type: {dict(error_types)}")
        assert acct.errors > 0, "prompts past their deadline became error records"
        t0 = clock.samples[0][0]
        timeline = [(round(at - t0, 1), c, r) for at, c, r in clock.samples[::10]]
        restored = None if clock.restored_at is None else clock.restored_at - t0
        assert clock.seconds is not None, (
            f"nothing stored after the replicas came back ({restored}): {timeline}"
        )
        settle(
            fault_table,
            f"every LLM replica down for 20 s ({acct.errors} error records)",
            records,
            watcher,
            clock,
            bootstrap=stack.kafka_bootstrap,
            sinks=iso.sinks(),
            iso=iso,
        )


# ---- e. one misbehaving LLM replica among healthy ones -------------------------------------------------
BAD_EVENTS = 600
BAD_RATE = 60.0


@pytest.mark.parametrize("kind", [*BAD_ANSWERS, "mixed"])
def test_one_replica_of_three_sends_bad_answers(
    kind: str,
    stack: StackState,
    iso: Isolated,
    tmp_path: Path,
    fault_table: FaultTable,
    runner_log: RunnerLog,
) -> None:
    """One replica answers every request with a 200 that is no answer (megabytes, the wrong types, an
    HTML page, nothing, or text that is not the understanding JSON) while two answer well: the runner
    never stops, every event and prompt is accounted for, at most 1% of prompts become error records
    (a bad answer is tried once more elsewhere), and the bad replica is quarantined within seconds with
    its reason on ``/metrics``."""
    replicas = OwnReplicas(tmp_path, count=3, time_scale=SIM_TIME_SCALE, extra={0: ["--bad-answer", kind]})
    with stopping(replicas):
        replicas.start()
        create_topics(stack.kafka_bootstrap, iso)
        records = SyntheticStream(shoppers=40, seed=81, malformed_rate=0.01).take(BAD_EVENTS)
        runner = EmbeddedRunner(
            iso.runner(llm=iso.llm(endpoints=replicas.endpoints, policy="prefix_aware"), drain_idle_s=3.0),
            log=runner_log,
        )
        producer = PacedProducer(stack.kafka_bootstrap, iso.topic, records, BAD_RATE).start()
        quarantined_after: list[float] = []
        at_quarantine: dict[str, float] = {}

        async def inject(clock: RecoveryClock) -> None:
            started = time.monotonic()
            await wait_until(
                lambda: (
                    getattr(runner, "client", None) is not None and runner.client.endpoints[0].quarantined
                ),
                "the bad replica's quarantine",
            )
            quarantined_after.append(time.monotonic() - started)
            at_quarantine["in_flight"] = runner.client.endpoints[0].outstanding
            at_quarantine["at"] = time.monotonic()
            at_quarantine["bad"] = await asyncio.to_thread(replicas.bad_answers_sent, 0)
            clock.restored()

        with SignalWatcher(stack.redis_url, iso.prefix) as watcher:
            clock = asyncio.run(run_with_fault(runner, inject, progress="results"))
        producer.join()
        bad_sent = replicas.bad_answers_sent(0)
        # once quarantined, the replica gets only what was in flight to it then, and probes
        probes = 1 + int(
            (time.monotonic() - at_quarantine["at"]) / runner.client.config.answer_health.cooldown_s
        )
        after = bad_sent - at_quarantine["bad"]
        acct = runner.stats.accounting
        assert acct.balanced, runner_log[-10:]
        bad = runner.client.endpoints[0]
        exposition = runner.metrics.exposition().decode()
        state = f'shopper_llm_endpoint_state{{endpoint="{bad.name}",state="{bad.routing_state}"}} 1.0'
        print(
            f"\n{kind}: quarantined after {quarantined_after[0]:.1f} s; {bad_sent} bad answers sent; "
            f"{acct.errors} error records of {acct.prompts} prompts; reason: {bad.out_reason}"
        )
        assert bad.quarantined and bad.routing_state.startswith("quarantined_") and state in exposition
        assert bad.out_reason and "bad answers" in bad.out_reason
        assert acct.errors <= 0.01 * acct.prompts, [line for line in runner_log if "error record" in line][:5]
        assert after <= at_quarantine["in_flight"] + probes, (
            f"after its quarantine the bad replica got {after} requests "
            f"({at_quarantine['in_flight']:.0f} were in flight then, {probes} probes)"
        )
        settle(
            fault_table,
            f"one replica of 3 sends bad answers ({kind}): quarantined after {quarantined_after[0]:.1f} s, "
            f"{bad_sent} bad answers, {acct.errors} error records",
            records,
            watcher,
            clock,
            bootstrap=stack.kafka_bootstrap,
            sinks=iso.sinks(),
            iso=iso,
        )


# ---- f. a worker killed during a rebalance ----------------------------------------------------------
class Worker:
    """``shopper run`` as a process of its own; its log lines are kept with their arrival times."""

    def __init__(self, iso: Isolated, *extra: str) -> None:
        command = [sys.executable, "-m", "shopper", "run", "--no-from-stack", "--group-id", iso.group, *extra]
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            command,
            env=worker_env(iso),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, text: str, after: float = 0.0) -> float | None:
        return next((at for at, line in list(self.lines) if text in line and at >= after), None)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-15:])


def worker_env(iso: Isolated) -> dict[str, str]:
    settings = iso.runner()
    return {
        **os.environ,
        "RUNNER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "RUNNER_TOPIC": settings.topic,
        "RUNNER_DLQ_TOPIC": settings.dlq_topic,
        "RUNNER_COMMIT_INTERVAL_S": "0.3",
        "RUNNER_DRAIN_IDLE_S": "3",
        "RUNNER_TIMER_WALL_PER_EVENT_S": "1000",
        "RUNNER_MAX_IN_FLIGHT_PROMPTS": "32",
        "RUNNER_LLM__ENDPOINTS": orjson.dumps(iso.stack.stream_endpoints).decode(),
        "RUNNER_SINKS__REDIS_URL": settings.sinks.redis_url,
        "RUNNER_SINKS__REDIS_KEY_PREFIX": iso.prefix,
        "RUNNER_SINKS__S3_ENDPOINT_URL": settings.sinks.s3_endpoint_url or "",
        "RUNNER_SINKS__S3_BUCKET": settings.sinks.s3_bucket,
        "RUNNER_SINKS__S3_PREFIX": iso.s3_prefix,
        "RUNNER_SINKS__INSIGHTS_TOPIC": iso.insights_topic,
        "RUNNER_SINKS__S3_ACCESS_KEY_ID": settings.sinks.s3_access_key_id or "",
        "RUNNER_SINKS__S3_SECRET_ACCESS_KEY": "testing",
        "RUNNER_SINKS__S3_MAX_AGE_S": "0.5",
    }


def committed_offsets(bootstrap: str, iso: Isolated, partitions: int = 4) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": iso.group, "enable.auto.commit": False})
    try:
        tps = [TopicPartition(iso.topic, p) for p in range(partitions)]
        return {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()


def test_two_workers_one_sigkilled_during_a_rebalance(
    stack: StackState, iso: Isolated, fault_table: FaultTable
) -> None:
    create_topics(stack.kafka_bootstrap, iso)
    records = stream(seed=75)
    expected = expected_prompts(records)
    producer = PacedProducer(stack.kafka_bootstrap, iso.topic, records, RATE).start()
    first = Worker(iso)
    second: Worker | None = None
    try:
        with SignalWatcher(stack.redis_url, iso.prefix) as watcher:
            deadline = time.monotonic() + 90
            while first.first("rebalance: assigned") is None or len(watcher.highest) < 5:
                assert first.process.poll() is None, first.tail()
                assert time.monotonic() < deadline, "the first worker made no progress"
                time.sleep(0.05)
            joined_at = time.monotonic()
            second = Worker(iso, "--until-drained")
            # The second member's join makes the first revoke its partitions: kill it right there,
            # while it hands them over.
            while first.first("rebalance: revoking", after=joined_at) is None:
                assert first.process.poll() is None, first.tail()
                assert time.monotonic() < deadline + 60, "no rebalance began"
                time.sleep(0.005)
            first.kill()
            killed_at = time.monotonic()
            try:
                code = second.process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the survivor did not drain:\n{second.tail()}") from None
            assert code == 0, second.tail()
            producer.join()
        owns_all = second.first("rebalance: assigned partitions [0, 1, 2, 3]", after=killed_at)
        view = read_back(
            bootstrap=stack.kafka_bootstrap,
            dlq_topic=iso.dlq_topic,
            sinks=iso.sinks(),
            redis_prefix=iso.prefix,
            s3_prefix=iso.s3_prefix,
            expected=expected,
            malformed=sum(m for *_, m in records),
        )
        assert set(committed_offsets(stack.kafka_bootstrap, iso).values()) != {-1001}
        finish(
            fault_table,
            "2 workers, one SIGKILLed while revoking in a rebalance",
            records,
            view,
            watcher,
            None if owns_all is None else owns_all - killed_at,
        )
    finally:
        first.kill()
        if second is not None:
            second.kill()
