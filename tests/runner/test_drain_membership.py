"""A stop that drains for longer than ``max.poll.interval.ms`` keeps the member in the group.

The drain waited for the prompts in flight without polling. When the fleet took longer than the poll
interval to answer them (seen at the end of a saturated ``bench.overload`` probe: a minute of draining),
librdkafka took the member out of the group, and the drain's last commit failed ("commit skipped, the
group is rebalancing"), so a restart replayed everything the drain had just made durable. Now the drain
polls on with its partitions paused. Against a replica whose answers start later than the poll
interval, and the real broker.
"""

from __future__ import annotations

import time

import pytest

from llm_client.config import Timeouts
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, stop_while_answers_wait
from tests.runner.test_revoked_commits import committed

pytestmark = pytest.mark.slow

MAX_POLL_INTERVAL_MS = 7000
"""The smallest librdkafka allows beside the runner's 6 s session timeout."""
ANSWER_DELAY_MS = 2 * MAX_POLL_INTERVAL_MS
"""How late each answer starts: the drain outlasts the poll interval twice over."""
SHOPPERS = 8


def test_a_drain_longer_than_the_poll_interval_stays_in_the_group_and_commits(isolated: Isolated) -> None:
    log = RunnerLog()
    now = time.time() - 600
    records = [cart_add(f"shopper-{i:02d}", now) for i in range(SHOPPERS)]
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)

    runner = run_showing_logs(
        stop_while_answers_wait(
            isolated,
            log,
            records=len(records),
            in_flight=SHOPPERS,
            answer_delay_ms=ANSWER_DELAY_MS,
            timeouts=Timeouts(connect_s=2, attempt_s=60, deadline_s=90),
            kafka_max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        ),
        runner=log,
    )

    assert not [line for line in log if "poll interval" in line or "commit skipped" in line], log.render()
    acct = runner.stats.accounting
    assert acct.balanced and acct.insights == SHOPPERS, acct
    offsets = committed(isolated.stack.kafka_bootstrap, isolated.group, isolated.topic)
    # A partition that got no record has no commit (a negative offset); the others end at their last.
    assert sum(o for o in offsets.values() if o > 0) == len(records), (offsets, log.render())
