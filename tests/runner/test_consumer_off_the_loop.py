"""The runner never calls its Kafka consumer on the event loop.

While a synchronous commit waits on a coordinator that cannot be reached (a broker outage), the Python
client of librdkafka blocks every other call on the same consumer (``position``, ``assignment``,
``pause`` alike) until the commit returns. One such call on the loop froze the runner, ``/metrics``,
its timers and the LLM answers with it for as long as the broker was away: the broker fault case once
hung 600 s that way, its loop in ``position`` behind a commit to a broker that had died. So every
consumer call goes on a thread, and what the loop shows (the lag) is the last such measurement.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from confluent_kafka import Consumer

import runner.embedded
from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.helpers import produce_records

WATCHED = (
    "position",
    "assignment",
    "pause",
    "resume",
    "get_watermark_offsets",
    "commit",
    "committed",
    "consume",
    "poll",
    "list_topics",
    "close",
    "unsubscribe",
)
"""Every call that can wait on the consumer's lock while a commit is out (subscribe, made once before
any commit, is the one allowed on the loop)."""


class ThreadWatchedConsumer(Consumer):
    """The real consumer, noting each call made on the event loop's thread and each call by name."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.loop_thread = threading.current_thread()  # built on the loop, in the runner's run()
        self.on_loop: list[str] = []
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        attribute = super().__getattribute__(name)
        if name not in WATCHED:
            return attribute
        calls, on_loop = super().__getattribute__("calls"), super().__getattribute__("on_loop")
        loop_thread = super().__getattribute__("loop_thread")

        def watched(*args: Any, **kwargs: Any) -> Any:  # the thread that calls, not the one that looks up
            calls[name] = calls.get(name, 0) + 1
            if threading.current_thread() is loop_thread:
                on_loop.append(name)
            return attribute(*args, **kwargs)

        return watched


def test_no_consumer_call_is_made_on_the_event_loop(
    isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner.embedded, "Consumer", ThreadWatchedConsumer)
    records = SyntheticStream(shoppers=40, seed=61).take(1500)
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    # Few prompts in flight, so backpressure pauses and resumes reading; a short progress interval, so
    # the lag is measured many times.
    settings = isolated.runner(max_in_flight_prompts=8, progress_interval_s=0.2, commit_interval_s=0.2)
    subject = EmbeddedRunner(settings, log=lambda _: None)
    stats = asyncio.run(subject.run())
    consumer = subject.consumer
    assert isinstance(consumer, ThreadWatchedConsumer)
    assert stats.accounting.balanced and stats.accounting.consumed == len(records)
    assert stats.paused_times > 0, "backpressure never paused: the pause and resume calls went untested"
    assert consumer.calls.get("position", 0) > 0 and consumer.calls.get("commit", 0) > 0
    assert consumer.on_loop == [], f"consumer calls on the event loop: {sorted(set(consumer.on_loop))}"
