"""The runner judges event time against each record's Kafka timestamp, through the real broker: one cart
add stamped a day ahead (a device clock) is dead-lettered with an event-time reason and counted, and the
shopper's later cart adds and purchase still prompt, the newest answered (latest wins, the default
overload policy, may supersede the older ones)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import orjson
import pytest
import redis as sync_redis

from prompt_assembly.events import EVENT_TIME_REASON
from runner.embedded import EmbeddedRunner
from shopper.readback import read_dlq
from tests.conftest import Isolated
from tests.helpers import produce_records

pytestmark = pytest.mark.slow

DAY_S = 86_400.0


def value(event_id: str, kind: str, ts: float) -> bytes:
    product = {"product_id": "p-1", "title": "Witch Hat", "price": 9.5}
    return orjson.dumps(
        {"event_id": event_id, "shopper_id": "s-1", "type": kind, "ts": ts, "product": product}
    )


def test_a_future_stamped_event_is_dead_lettered_and_the_shopper_still_answered(isolated: Isolated) -> None:
    settings = isolated.runner()
    interval = settings.session.triggers.min_prompt_interval_s
    now = time.time()  # the records' Kafka timestamps are their send time: now
    later = [("c0", "add_to_cart"), ("c1", "add_to_cart"), ("p0", "purchase")]
    values = [value("v0", "view", now), value("future", "add_to_cart", now + DAY_S)]
    values += [value(eid, kind, now + (i + 1) * 2 * interval) for i, (eid, kind) in enumerate(later)]
    # Within the allowed skew of their records' timestamps: the later events are a few seconds ahead.
    assert (len(later) + 1) * 2 * interval <= settings.session.event_time.max_ahead_s
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, [(b"s-1", v, False) for v in values])

    stats = asyncio.run(EmbeddedRunner(settings, log=lambda _: None).run())

    acct = stats.accounting
    assert acct.dead_lettered == 1 and stats.dead_letters.by_reason["event_time"] == 1
    (letter,) = read_dlq(isolated.stack.kafka_bootstrap, isolated.dlq_topic)
    assert str(letter["reason"]).startswith(EVENT_TIME_REASON) and "future" in str(letter["original"])
    # One prompt per cart add and purchase, each at once, plus the view's browse pause (which the first
    # cart add, a quiet period later, fires). With the future event accepted, they waited a day.
    # Latest wins answers the newest, the purchase; the older ones it may have superseded.
    assert acct.prompts == acct.insights + acct.superseded == len(later) + 1 and acct.errors == 0
    client = sync_redis.Redis.from_url(isolated.stack.redis_url)
    try:
        assert cast(bytes, client.hget(f"{isolated.prefix}signals:s-1", "reason")) == b"purchase"
    finally:
        client.close()
