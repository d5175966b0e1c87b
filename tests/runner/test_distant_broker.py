"""A broker 50 ms away, and a steady stream: the runner keeps making its progress durable.

At a durable point the runner waits for the delivery reports of what its producers were handed (results
on the insights topic, dead letters, re-keyed copies), but the stream goes on meanwhile. Its waits used
librdkafka's ``flush``, which returns only once a producer's queue is empty, and over a link whose round
trip is longer than the gap between two records the queue never is: the durable point waited until the
stream paused or its time ran out, and the runner failed (``DeadLettersUndelivered``,
``RekeyUndelivered``, ``SinkWriteFailed``) with the broker healthy all along. On loopback the queue
empties between records, so no other test saw it. Here a Tansu of the test's own is reached only
over a link that delays every byte 50 ms each way (``tests.slow_link``); the stream mixes cart adds
(each a prompt, whose result goes to the insights topic), unkeyed views (re-keyed) and malformed records
(dead letters), one every 5 ms, with the runner's default settings.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, wait_until
from tests.runner.kit import cart_add, run_showing_logs, running, view
from tests.slow_link import tansu_behind_slow_link

pytestmark = pytest.mark.slow

LINK_DELAY_S = 0.05
GAP_S = 0.005
STREAM_S = 12.0
SHOPPERS = 20


def steady_record(i: int) -> tuple[bytes | None, bytes]:
    """Of every ten records: one cart add (keyed), then unkeyed views and malformed records in turn;
    event times now."""
    sid = f"shopper-{i % SHOPPERS:02d}"
    if i % 10 == 0:
        key, value, _ = cart_add(sid, time.time())
        return key, value
    if i % 2:
        return None, view(sid, time.time())
    return sid.encode(), b"not json " + uuid.uuid4().hex.encode()


def test_durable_points_keep_up_with_a_steady_stream_over_a_slow_link(
    isolated: Isolated, tmp_path: Path
) -> None:
    with tansu_behind_slow_link(tmp_path, LINK_DELAY_S) as bootstrap:
        isolated.create_topics(bootstrap=bootstrap)
        defaults = RunnerSettings.model_fields
        settings = isolated.runner(
            bootstrap_servers=bootstrap,
            until_drained=False,
            commit_interval_s=defaults["commit_interval_s"].default,
            timer_wall_per_event_s=defaults["timer_wall_per_event_s"].default,
        )
        log = RunnerLog()
        runner = EmbeddedRunner(settings, log=log)
        count = int(STREAM_S / GAP_S)
        unkeyed = sum(1 for i in range(count) if steady_record(i)[0] is None)
        malformed = sum(1 for i in range(count) if steady_record(i)[1].startswith(b"not json"))

        async def scenario() -> None:
            async with running(runner) as (task,):
                await wait_until(lambda: bool(runner.assigned_partitions()), "partitions assigned")
                producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
                commits_before = runner.checkpoint.commits
                for i in range(count):
                    key, value = steady_record(i)
                    producer.produce(isolated.topic, key=key, value=value)
                    producer.poll(0)
                    await asyncio.sleep(GAP_S)
                    assert not task.done(), "the runner stopped mid-stream"
                commits_during = runner.checkpoint.commits - commits_before
                assert await asyncio.to_thread(producer.flush, 30) == 0
                # Each durable point waited for an empty queue: none completed while the stream ran.
                assert commits_during >= 4, f"{commits_during} offset commits in {STREAM_S:.0f} s of stream"
                accounting = runner.stats.accounting
                await wait_until(
                    lambda: accounting.consumed >= count + unkeyed and not runner.epochs,
                    "every record (and every re-keyed copy) consumed and made durable",
                )

        run_showing_logs(scenario(), runner=log)
        accounting = runner.stats.accounting
        assert accounting.balanced, accounting
        assert accounting.rekeyed == unkeyed
        assert runner.stats.dead_letters.delivered == malformed
