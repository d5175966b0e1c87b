"""Records fetched while the runner waits for the session store, across two rebalances.

While a session load waits out a Redis outage the poll loop keeps polling with its partitions paused
(``runner.ingest.Ingest.polling_while``). A rebalance meanwhile assigns and resumes partitions, so
their records come, and are held for the next poll. A second rebalance hands that assignment over:
the partitions fetch the same records again from the committed offsets (the runner's assignment is
eager), and those held from the first were applied as well, twice. Against the real broker, a
redis-server of the test's own (``OwnRedis``), and a second member of the group that joins and leaves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis, RunnerLog, stopping, wait_until
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, running

pytestmark = pytest.mark.slow

REVOKE_TIMEOUT_S = 2.0
"""How long each revoke waits for a durable point that Redis, down, never gives: short, for the test."""


class Member:
    """A second member of the runner's group, polling on a thread of its own until it leaves."""

    def __init__(self, isolated: Isolated) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": isolated.stack.kafka_bootstrap,
                "group.id": isolated.group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
                "partition.assignment.strategy": "range",  # the runner's
            }
        )
        self.assigned: list[TopicPartition] = []
        self._leave = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(isolated.topic,), daemon=True)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.assigned = list(partitions)

    def _poll(self, topic: str) -> None:
        self.consumer.subscribe([topic], on_assign=self._on_assign)
        while not self._leave.is_set():
            self.consumer.poll(0.2)
        self.consumer.close()  # leaves the group: the second rebalance

    def join(self) -> None:
        self._thread.start()

    def leave(self) -> None:
        self._leave.set()
        self._thread.join(30)


def test_records_held_from_an_assignment_handed_over_are_not_applied_again(
    isolated: Isolated, tmp_path: Path
) -> None:
    log = RunnerLog()
    redis = OwnRedis(tmp_path)
    now = time.time() - 600
    first = [cart_add(f"shopper-{i:02d}", now) for i in range(8)]
    second = [cart_add(f"newcomer-{i:02d}", now) for i in range(24)]  # not in memory: a load
    member = Member(isolated)
    with stopping(redis):
        redis.start()
        sinks = isolated.sinks().model_copy(update={"redis_url": redis.url})
        settings = isolated.runner(sinks=sinks, revoke_timeout_s=REVOKE_TIMEOUT_S)
        runner = EmbeddedRunner(settings, log=log)
        produce_records(isolated.stack.kafka_bootstrap, isolated.topic, first)

        def assignments() -> int:
            return sum(1 for line in log if line.startswith("rebalance: assigned"))

        async def scenario() -> None:
            async with running(runner) as (task,):
                acct = runner.stats.accounting
                await wait_until(lambda: acct.insights == len(first) and runner.stats.commits > 0, "first")
                await asyncio.to_thread(redis.kill)
                retries = runner.stats.sink_retries
                await asyncio.to_thread(
                    produce_records, isolated.stack.kafka_bootstrap, isolated.topic, second
                )
                await wait_until(
                    lambda: runner.stats.sink_retries > retries, "a session load meeting the outage"
                )
                member.join()  # the first rebalance: the runner keeps two of the four partitions
                await wait_until(lambda: assignments() == 2 and bool(member.assigned), "the first rebalance")
                # The runner's two partitions are resumed: their records come while the load waits.
                await wait_until(lambda: runner.ingest.held_records > 0, "records held from the first")
                await asyncio.to_thread(member.leave)  # the second: all four back to the runner
                await wait_until(lambda: assignments() == 3, "the second rebalance")
                await wait_until(lambda: runner.ingest.held_records > 0, "records held from the second")
                await asyncio.to_thread(redis.start)
                await asyncio.wait_for(task, 180)

        try:
            run_showing_logs(scenario(), runner=log)
        finally:
            member.leave()

    acct = runner.stats.accounting
    # Each record applied once: none counted twice as consumed, none a duplicate of itself.
    assert acct.duplicates == 0, (acct, log.render())
    assert acct.consumed == len(first) + len(second), (acct, log.render())
    assert acct.balanced and acct.insights == len(first) + len(second), acct
