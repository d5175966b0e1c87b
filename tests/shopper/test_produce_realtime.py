"""``shopper produce --realtime-ts`` makes a live stream: every valid event passes the runner's
event-time gate at its defaults, and ``shopper signals`` then says how many seconds ago it happened."""

from __future__ import annotations

import time

import pytest

from runner.embedded import EmbeddedRunner
from shopper.producer import produce
from shopper.readback import read_signals, signal_age
from tests.conftest import Isolated

pytestmark = pytest.mark.timeout(300)


async def test_realtime_events_pass_the_event_time_gate_and_read_back_as_just_now(isolated: Isolated) -> None:
    """The simulated clock only started at the wall clock and ran ahead of it: of 200 events from 10
    shoppers, 118 were stamped more than 300 s after their record (sent without a timestamp, so
    stamped by librdkafka at send) and dead-lettered; the signals then showed negative event ages."""
    sent_at = time.time()
    report = produce(
        isolated.stack.kafka_bootstrap,
        isolated.topic,
        events=200,
        shoppers=10,
        rate=None,
        malformed_rate=0.0,
        seed=7,
        realtime_ts=True,
    )
    stats = await EmbeddedRunner(isolated.runner(), log=lambda _: None).run()
    acct = stats.accounting
    assert (acct.dead_lettered, acct.accepted + acct.duplicates) == (0, report.sent), acct.as_dict()
    assert acct.balanced and acct.insights > 0, acct.as_dict()
    rows = await read_signals(isolated.stack.redis_url, [], 10, prefix=isolated.prefix)
    assert rows
    now = time.time()
    for row in rows:
        event_age, write_age = (float(part.replace(",", "")) for part in signal_age(row, now).split(" / "))
        assert 0 <= write_age <= event_age <= now - sent_at + 1, signal_age(row, now)
