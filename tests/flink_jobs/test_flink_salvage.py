"""The Flink session function reads a stored session this code cannot read (another version's state,
after a rollback, or a corrupted value) as the runner does (``ShopperSession.salvage``): it goes on,
counts it, and its save replaces the value. Before, the read raised, which fails the job, and every
restart from the checkpoint failed at the same shopper."""

from __future__ import annotations

import time
from collections import Counter

import orjson

from flink_jobs.flink_config import NearRealtimeSettings
from prompt_assembly.records import PromptRequest
from prompt_assembly.session import ShopperSession, session_epoch
from tests.flink_jobs.test_flink_units import _KeyedContext, _RuntimeContext


class _CountingMetrics:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add_group(self, name: str) -> _CountingMetrics:
        return self

    def counter(self, name: str) -> _Count:
        return _Count(self.counts, name)


class _Count:
    def __init__(self, counts: Counter[str], name: str) -> None:
        self.counts, self.name = counts, name

    def inc(self, n: int = 1) -> None:
        self.counts[self.name] += n


class _Runtime(_RuntimeContext):
    def __init__(self) -> None:
        super().__init__()
        self.metrics = _CountingMetrics()

    def get_metrics_group(self) -> _CountingMetrics:  # type: ignore[override]
        return self.metrics


def cart_add(event_id: str, ts: float) -> str:
    product = {"product_id": "p-1", "title": "Trail shoe", "price": 90.0}
    event = {"event_id": event_id, "shopper_id": "s-1", "type": "add_to_cart", "ts": ts, "product": product}
    return orjson.dumps(event).decode()


def test_an_unreadable_session_state_is_started_over_counted_and_replaced() -> None:
    from flink_jobs.flink_functions import ShopperSessionFunction

    function = ShopperSessionFunction(NearRealtimeSettings().to_json(), True, False)
    runtime = _Runtime()
    function.open(runtime)
    runtime.states["session"].update('{"h": {"shopper_id": "s-1", "version": 9}, "entries": [{"g": 0}]}')

    ts = time.time()
    out = list(function.process_element(cart_add("e-1", ts), _KeyedContext("s-1")))

    (prompt,) = [PromptRequest.model_validate_json(raw) for raw in out]
    assert prompt.shopper_id == "s-1" and prompt.session_epoch == session_epoch(ts)
    assert runtime.metrics.counts["sessions_salvaged"] == 1
    assert runtime.metrics.counts["session_entries_unreadable"] == 1
    stored = runtime.states["session"].value()
    assert stored is not None
    session, damage = ShopperSession.salvage_json("s-1", stored)
    assert damage is None and [event.event_id for event in session.events] == ["e-1"]
