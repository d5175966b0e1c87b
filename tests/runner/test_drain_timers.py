"""No timer fires once a stop's drain has begun, against the real broker, Redis and a simulator replica.

The timer worker ran on through the drain. A browse pause falling due while the drain waited for the
answers in flight, or while it made them durable, launched a prompt: during the final commit nobody
waited for it or stored its answer, and the next run paid for it again. Now the drain stops the timers
first; the pending trigger stays in the session store, with its deadline, for the next owner.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from llm_client.config import Timeouts
from runner.session_store import RedisSessionStore
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, shopper_record, stop_while_answers_wait

pytestmark = pytest.mark.slow

ANSWER_DELAY_MS = 4000
"""How late the cart add's answer starts: the drain waits at least this long."""
TIMER_WALL_PER_EVENT_S = 0.05
"""The browse pause (a 20 s quiet period) falls due 1 s of wall time after the view: inside the drain."""


def test_a_browse_pause_due_during_the_drain_stays_pending_in_the_store(isolated: Isolated) -> None:
    log = RunnerLog()
    now = time.time() - 600
    records = [cart_add("buyer", now), shopper_record("browser", now, "view")]
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)

    runner = run_showing_logs(
        stop_while_answers_wait(
            isolated,
            log,
            records=len(records),
            in_flight=1,  # the cart add's prompt
            answer_delay_ms=ANSWER_DELAY_MS,
            timeouts=Timeouts(connect_s=2, attempt_s=30, deadline_s=60),
            timer_wall_per_event_s=TIMER_WALL_PER_EVENT_S,
        ),
        runner=log,
    )

    acct = runner.stats.accounting
    assert acct.balanced and acct.insights == 1 and acct.prompts == 1, (acct, log.render())
    assert runner.in_flight == 0

    async def stored() -> tuple[object, list[tuple[str, float]]]:
        redis = aioredis.Redis.from_url(isolated.stack.redis_url)
        try:
            store = RedisSessionStore(redis, isolated.prefix)
            session = (await store.load_many(["browser"]))["browser"]
            timers = [t for p in range(4) for t in await store.timers(p)]
            return session.pending, timers
        finally:
            await redis.aclose()

    pending, timers = asyncio.run(stored())
    assert pending is not None and pending.reason == "browse_pause"  # type: ignore[attr-defined]
    assert [shopper for shopper, _ in timers] == ["browser"], "armed for the next owner"
