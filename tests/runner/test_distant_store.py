"""A session store 60 ms away: the ingest does not pause its partitions for every load.

While it waits for the session store the poll loop polls on with its partitions paused, so that an
outage does not take the member out of the group. It paused once a wait outlasted the poll timeout
(50 ms), and pausing drops the records librdkafka has fetched ahead, fetched again on resume: with the
store one round trip of 60 ms away (another zone under load, another region), or a cold start's large
replies, nearly every poll with a new shopper paused and fetched its partitions' records again. Now a
wait runs a second before it pauses (``runner.ingest.STORE_WAIT_BEFORE_PAUSE_S``), and the pauses are
counted (``long_wait_pauses``). The stack's Redis behind a link that delays every byte 30 ms each way
(``tests.slow_link``), a backlog of new shoppers, the runner's defaults otherwise.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest

from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, wait_until
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, running
from tests.slow_link import SlowLink

pytestmark = pytest.mark.slow

SHOPPERS = 30


def test_a_store_a_round_trip_of_60_ms_away_pauses_no_poll(isolated: Isolated) -> None:
    redis = urlsplit(isolated.stack.redis_url)
    assert redis.port is not None
    link = SlowLink(redis.port, delay_s=0.03)
    link.start()
    try:
        sinks = isolated.sinks().model_copy(update={"redis_url": f"redis://127.0.0.1:{link.port}/0"})
        log = RunnerLog()
        runner = EmbeddedRunner(isolated.runner(sinks=sinks, until_drained=False), log=log)
        now = time.time() - 600
        records = [cart_add(f"shopper-{i:03d}", now + i) for i in range(SHOPPERS)]
        produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)

        async def scenario() -> int:
            async with running(runner):
                acct = runner.stats.accounting
                await wait_until(lambda: acct.insights == SHOPPERS and not runner.epochs, "all durable")
                return runner.stats.long_wait_pauses  # before the stop, whose drain may wait longer

        pauses = run_showing_logs(scenario(), runner=log)
    finally:
        link.stop()
    accounting = runner.stats.accounting
    assert accounting.balanced and accounting.accepted == SHOPPERS, accounting
    assert pauses == 0, "a wait for the store paused the partitions"
