"""A long Redis outage while the runner needs a session load.

The poll loop awaited the load under ``sink_retry`` (120 s by default) without polling, so after
``max.poll.interval.ms`` librdkafka took the member out of the group and its partitions moved; and
when the retry limit passed, the runner ended with the Redis client's traceback. Now it polls on with
its partitions paused while it waits, and a load that stays down ends it with one line
(``SessionStoreUnavailable``). Against a redis-server of the test's own, stopped and started again on
the same port and data (``OwnRedis``), and the real broker.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from pipeline.sink_retry import SinkRetry
from runner.embedded import EmbeddedRunner
from runner.errors import SessionStoreUnavailable
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis, RunnerLog, stopping, wait_until
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, running

pytestmark = pytest.mark.slow

MAX_POLL_INTERVAL_MS = 7000
"""The smallest librdkafka allows beside the runner's 6 s session timeout, so an outage that outlasts it
is short enough for a test."""
DRAIN_IDLE_S = 10.0
"""Time for the test to produce the second batch after the first is made durable."""
OUTAGE_POLL_INTERVALS = 3
"""How many poll intervals the outage lasts: well past the point where the member used to leave."""


def test_a_redis_outage_longer_than_the_poll_interval_keeps_the_member_in_the_group(
    isolated: Isolated, tmp_path: Path
) -> None:
    log = RunnerLog()
    redis = OwnRedis(tmp_path)
    now = time.time() - 600
    first = [cart_add(f"shopper-{i:02d}", now) for i in range(8)]
    second = [cart_add(f"newcomer-{i:02d}", now) for i in range(8)]  # not in memory: a load
    with stopping(redis):
        redis.start()
        sinks = isolated.sinks().model_copy(update={"redis_url": redis.url})
        # Drained once the first batch is in, the runner would end after ``drain_idle_s`` (1 s by
        # default): the second batch must come before that, and a first durable point late in that
        # second left it too little time (seen once in 170 runs of the runner tests).
        settings = isolated.runner(
            sinks=sinks, kafka_max_poll_interval_ms=MAX_POLL_INTERVAL_MS, drain_idle_s=DRAIN_IDLE_S
        )
        runner = EmbeddedRunner(settings, log=log)
        produce_records(isolated.stack.kafka_bootstrap, isolated.topic, first)

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
                await asyncio.sleep(OUTAGE_POLL_INTERVALS * MAX_POLL_INTERVAL_MS / 1000)
                await asyncio.to_thread(redis.start)
                await asyncio.wait_for(task, 180)

        run_showing_logs(scenario(), runner=log)

    # One assignment, and at most the revoke of the consumer's close at the end: never a leave and a
    # rejoin in between (each revoke also logs how its hand-over went: not a rebalance of its own).
    rebalances = [line for line in log if line.startswith(("rebalance: assigned", "rebalance: revoking"))]
    assert rebalances[0] == "rebalance: assigned partitions [0, 1, 2, 3]", log.render()
    assert [line for line in rebalances if "assigned" in line] == rebalances[:1], log.render()
    assert len(rebalances) <= 2, log.render()
    assert not [line for line in log if "poll interval" in line], log.render()
    acct = runner.stats.accounting
    assert acct.balanced and acct.insights == len(first) + len(second), acct


def test_a_session_load_past_the_retry_limit_ends_the_runner_with_one_line(
    isolated: Isolated, tmp_path: Path
) -> None:
    log = RunnerLog()
    redis = OwnRedis(tmp_path)
    now = time.time() - 600
    with stopping(redis):
        redis.start()
        sinks = isolated.sinks().model_copy(update={"redis_url": redis.url})
        settings = isolated.runner(sinks=sinks, sink_retry=SinkRetry(max_wait_s=2.0), until_drained=False)
        runner = EmbeddedRunner(settings, log=log)

        async def scenario() -> None:
            async with running(runner) as (task,):
                await wait_until(lambda: bool(runner.assigned_partitions()), "the assignment")
                await asyncio.to_thread(redis.kill)
                records = [cart_add(f"shopper-{i:02d}", now) for i in range(4)]
                await asyncio.to_thread(
                    produce_records, isolated.stack.kafka_bootstrap, isolated.topic, records
                )
                await asyncio.wait_for(task, 120)

        with pytest.raises(SessionStoreUnavailable) as failed:
            asyncio.run(scenario())

    message = str(failed.value)
    # The session load of the records produced, or the re-arm's timer load if Redis went before it ran,
    # or its fencing token's take before that (CI saw it once).
    assert "\n" not in message, message
    assert re.match(r"((session|timer) load|ownership) from Redis failed for", message), message
    assert "SINK_REDIS_URL" in message
    assert runner.stats.commits == 0
