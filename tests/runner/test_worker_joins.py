"""Scaling out the embedded runner: a second worker joins the consumer group mid-stream and takes over
partitions whose shoppers have triggers pending, as ``shopper run`` processes on the real stack.

Worker A consumes the first part of the stream alone and commits it; many shoppers end it with a
browse-pause trigger pending (saved with their sessions). Worker B joins; the group rebalances and B
is assigned partitions holding such shoppers. The second part of the stream arrives: on B's partitions
B must load each session with its pending trigger from the store, fire it from event time and go on
with the session's history. Both run ``--until-drained`` with a long quiet period: once the stream has
been quiet that long, each fires what is still pending in its sessions and exits. Redis and S3 must
then hold exactly the prompts the pure processor computes over the whole stream, each with its trigger
reason: a trigger lost or fired twice in the move, or a session that lost its history, changes a
prompt's ``seq`` or reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import MalformedEvent, parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.session import ShopperSession
from shopper.readback import list_s3_records
from tests.conftest import Isolated
from tests.helpers import expected_prompts, final_seq_by_shopper, produce_records
from tests.runner.test_pipeline_embedded import _runner_env, redis_seqs

pytestmark = pytest.mark.slow

PARTITIONS = 4
QUIET_S = 45
"""Each worker's ``drain_idle_s``: worker A, caught up, must still be up when B has joined."""


def _ends(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends-reader"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        }
    finally:
        consumer.close()


def _committed(bootstrap: str, isolated: Isolated) -> dict[int, int]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": isolated.group, "enable.auto.commit": False}
    )
    try:
        tps = [TopicPartition(isolated.topic, p) for p in range(PARTITIONS)]
        return {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()


def _wait_committed(isolated: Isolated, ends: dict[int, int], workers: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 180
    while True:
        committed = _committed(isolated.stack.kafka_bootstrap, isolated)
        if all(committed.get(p, -1) >= end for p, end in ends.items() if end > 0):
            return
        assert all(w.poll() is None for w in workers), "a worker exited"
        assert time.monotonic() < deadline, f"not committed: {committed} < {ends}"
        time.sleep(0.3)


def _partition_of_shoppers(bootstrap: str, topic: str) -> dict[str, int]:
    """Each shopper's partition, as the broker placed its records (keyed by shopper id)."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "partition-reader", "enable.auto.commit": False}
    )
    ends = _ends(bootstrap, topic)
    placed: dict[str, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        seen = dict.fromkeys(range(PARTITIONS), 0)
        deadline = time.monotonic() + 60
        while any(seen[p] < end for p, end in ends.items()) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            partition, key = message.partition(), message.key()
            assert partition is not None
            seen[partition] = (message.offset() or 0) + 1
            if key:
                placed[key.decode()] = partition
    finally:
        consumer.close()
    return placed


def _pending_after(records: list[tuple[bytes, bytes, bool]]) -> set[str]:
    processor = SessionProcessor()
    sessions: dict[str, ShopperSession] = {}
    for _, value, _ in records:
        try:
            event = parse_event(value)
        except MalformedEvent:
            continue
        session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
        processor.apply(session, event)
    return {sid for sid, session in sessions.items() if session.pending is not None}


def _assigned(log: Path) -> list[int]:
    """The partitions of the last assignment a worker logged."""
    assigned: list[int] = []
    for line in log.read_text(errors="replace").splitlines():
        if "rebalance: assigned partitions" in line:
            assigned = orjson.loads(line.rsplit("partitions", 1)[1].strip())
    return assigned


def test_a_worker_joining_mid_stream_takes_over_pending_triggers(isolated: Isolated, tmp_path: Path) -> None:
    stream = SyntheticStream(shoppers=40, seed=61, malformed_rate=0.01)
    first, second = stream.take(900), stream.take(900)
    bootstrap = isolated.stack.kafka_bootstrap
    # --until-drained with a long quiet period: A stays up, caught up, until B has joined; at the end
    # each worker fires what is still pending in its sessions, then exits.
    command = [
        sys.executable, "-m", "shopper", "run", "--no-from-stack", "--group-id", isolated.group,
        "--until-drained",
    ]  # fmt: skip
    env = _runner_env(isolated, RUNNER_DRAIN_IDLE_S=str(QUIET_S))
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}

    produce_records(bootstrap, isolated.topic, first)
    pending_at_join = _pending_after(first)
    assert pending_at_join, "the first part must leave triggers pending"
    workers: list[subprocess.Popen[bytes]] = []
    try:
        with logs["a"].open("wb") as out:
            workers.append(subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True))
        _wait_committed(isolated, _ends(bootstrap, isolated.topic), workers)
        with logs["b"].open("wb") as out:
            workers.append(subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True))
        deadline = time.monotonic() + QUIET_S
        while not (_assigned(logs["b"]) and len(_assigned(logs["a"])) < PARTITIONS):
            assert all(w.poll() is None for w in workers), [p.read_text()[-2000:] for p in logs.values()]
            assert time.monotonic() < deadline, "worker B was not assigned partitions while A was up"
            time.sleep(0.3)
        taken_over = set(_assigned(logs["b"]))
        produce_records(bootstrap, isolated.topic, second)
        for worker in workers:
            worker.wait(timeout=240)
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    assert all(w.returncode == 0 for w in workers), [p.read_text()[-2000:] for p in logs.values()]

    placed = _partition_of_shoppers(bootstrap, isolated.topic)
    moved = {sid for sid in pending_at_join if placed.get(sid) in taken_over}
    assert moved, f"no pending trigger moved to worker B (its partitions {sorted(taken_over)})"

    expected = expected_prompts([*first, *second])
    assert redis_seqs(isolated) == final_seq_by_shopper(expected)
    _, rows = list_s3_records(isolated.sinks(), isolated.s3_prefix)
    stored = {str(r["request_id"]): str(r["reason"]) for r in rows}
    assert stored == {rid: prompt.reason for rid, prompt in expected.items()}
