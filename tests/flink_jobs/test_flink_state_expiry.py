"""A pending trigger's drain timer does not outlive its session's state TTL (``flink_jobs.expiry_timers``).

With ``wall_clock_timers`` off and ``flush_on_drain`` on, a shopper whose last event left a trigger
pending keeps an event-time timer at ``Long.MAX``. Before, it was deleted only when the trigger fired, so
once the session's TTL had dropped the state the timer stayed (timer state grew with every shopper ever
seen), and at a drain it found no state and returned: the shopper's pending events were neither prompted
nor counted. The MiniCluster case below runs the session stage on a bounded input that waits past the TTL
before it ends (the drain); the others drive ``ShopperSessionFunction`` through its Flink calls, to check
what is counted where a session's state expired before its expiry timer could fire (a job down across
it)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

# PyFlink is the 'flink' extra, which `make test` installs: a missing PyFlink fails here, never skips.
import pyflink  # noqa: F401
import pytest
from pyflink.datastream.functions import FlatMapFunction, KeyedProcessFunction
from pyflink.datastream.time_domain import TimeDomain

from flink_jobs.expiry_timers import ExpiryTimer, expiry_deadline_ms, next_expiry
from flink_jobs.flink_config import CheckpointSettings, NearRealtimeSettings
from flink_jobs.flink_functions import FLUSH_TIMER_TS, ShopperSessionFunction
from tests.flink_jobs.test_flink_units import _ValueState

TTL_S = 3
SHOPPERS = 6
PROBE = "probe: "
WAIT = "wait past the TTL"


def _view(shopper: str, n: int, ts: float, kind: str = "view") -> bytes:
    product = {"product_id": f"p{n}", "title": "Trail shoe", "price": 90.0}
    event = {"event_id": f"{shopper}-e{n}", "shopper_id": shopper, "type": kind, "ts": ts, "product": product}
    return orjson.dumps(event)


class WaitPastTheTtl(FlatMapFunction):  # type: ignore[misc]  # PyFlink ships no types
    """Passes records on; at ``WAIT`` it sleeps (holding the input open) and drops it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def flat_map(self, value: str) -> Iterator[str]:
        if value == WAIT:
            time.sleep(self.seconds)
            return
        yield value


class ProbedSessions(ShopperSessionFunction):
    """The session function, reporting each drain timer that fires: one that does not outlive its
    session has been deleted before the drain."""

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterable[str]:
        if ctx.time_domain() == TimeDomain.EVENT_TIME:
            yield f"{PROBE}drain timer of {ctx.get_current_key()}"
        yield from super().on_timer(timestamp, ctx)


def _run_past_the_ttl(records: list[bytes], wait_s: float, checkpoints: Path) -> list[str]:
    """The session stage as the job runs it with ``wall_clock_timers`` off and ``flush_on_drain`` on
    (``near_realtime.build_pipeline``), on ``records`` then a wait of ``wait_s`` before the input ends."""
    from pyflink.common import Types

    from flink_jobs.flink_functions import shopper_key
    from flink_jobs.near_realtime import create_environment

    settings = NearRealtimeSettings(
        state_ttl_s=TTL_S,
        wall_clock_timers=False,
        flush_on_drain=True,
        checkpoint=CheckpointSettings(interval_ms=60_000, directory=checkpoints.as_uri()),
    )
    env = create_environment(settings, local=True)
    values = [base64.b64encode(r).decode() for r in records] + [WAIT]
    keyed = (
        env.from_collection(values, type_info=Types.STRING())
        .flat_map(WaitPastTheTtl(wait_s), output_type=Types.STRING())
        .key_by(shopper_key, key_type=Types.STRING())
    )
    function = ProbedSessions(settings.to_json(), False, True, None, True)
    made = keyed.process(function, output_type=Types.STRING())
    with made.execute_and_collect("state expiry") as collected:
        return list(collected)


@pytest.mark.flink
@pytest.mark.slow
def test_a_pending_trigger_is_prompted_before_its_state_expires_and_leaves_no_drain_timer(
    tmp_path: Path,
) -> None:
    """One view per shopper (a browse pause pending, due only by event time or at a drain), then the
    input waits well past the TTL and ends: each view is in a prompt made before its state expired, and
    no drain timer outlived its session."""
    now = time.time()
    records = [_view(f"s-{n}", 1, now) for n in range(SHOPPERS)]
    out = _run_past_the_ttl(records, TTL_S + 2.0, tmp_path)

    probes = sorted(line for line in out if line.startswith(PROBE))
    prompts = [orjson.loads(line) for line in out if not line.startswith(PROBE)]
    named = sorted(e for p in prompts for e in [*p["new_event_ids"], *p["trimmed_event_ids"]])
    assert named == sorted(f"s-{n}-e1" for n in range(SHOPPERS)), (
        f"accepted events no prompt names: {SHOPPERS - len(named)} of {SHOPPERS}; drain timers: {probes}"
    )
    assert {p["reason"] for p in prompts} == {"browse_pause"}
    assert probes == [], "a drain timer outlived its session's state"


# ---- the function's Flink calls, with the state and timers it sees -------------------------------------
class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, n: int = 1) -> None:
        self.count += n


class _Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, _Counter] = {}

    def add_group(self, name: str) -> _Metrics:
        return self

    def counter(self, name: str) -> _Counter:
        return self.counters.setdefault(name, _Counter())


class _Runtime:
    def __init__(self) -> None:
        self.states: dict[str, _ValueState] = {}
        self.metrics = _Metrics()

    def get_state(self, descriptor: Any) -> _ValueState:
        return self.states.setdefault(descriptor.get_name(), _ValueState())

    def get_metrics_group(self) -> _Metrics:
        return self.metrics


class _Timers:
    """One key's timers, as Flink's timer service holds them (a set per time domain)."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms
        self.processing: set[int] = set()
        self.event: set[int] = set()

    def current_processing_time(self) -> int:
        return self.now_ms

    def register_processing_time_timer(self, ts: int) -> None:
        self.processing.add(ts)

    def delete_processing_time_timer(self, ts: int) -> None:
        self.processing.discard(ts)

    def register_event_time_timer(self, ts: int) -> None:
        self.event.add(ts)

    def delete_event_time_timer(self, ts: int) -> None:
        self.event.discard(ts)


class _Context:
    def __init__(self, key: str, timers: _Timers, domain: Any = None) -> None:
        self.key, self.timers, self.domain = key, timers, domain

    def get_current_key(self) -> str:
        return self.key

    def timer_service(self) -> _Timers:
        return self.timers

    def time_domain(self) -> Any:
        return self.domain


def _opened() -> tuple[_Runtime, ShopperSessionFunction, _Timers]:
    """The session function as the job builds it with ``wall_clock_timers`` off and ``flush_on_drain``
    on, opened, and one key's timers at the time it opened."""
    settings = NearRealtimeSettings(state_ttl_s=3600, wall_clock_timers=False, flush_on_drain=True)
    function = ShopperSessionFunction(settings.to_json(), False, True, None, True)
    runtime = _Runtime()
    function.open(runtime)
    return runtime, function, _Timers(now_ms=function.started_ms)


def _fire(function: ShopperSessionFunction, timers: _Timers, domain: Any, ts: int) -> list[dict[str, Any]]:
    (timers.processing if domain == TimeDomain.PROCESSING_TIME else timers.event).discard(ts)
    return [orjson.loads(p) for p in function.on_timer(ts, _Context("s", timers, domain))]


def _accept(function: ShopperSessionFunction, timers: _Timers, *events: bytes) -> list[dict[str, Any]]:
    """The prompts that ``events`` of shopper "s" make at once."""
    made = (function.process_element(base64.b64encode(e).decode(), _Context("s", timers)) for e in events)
    return [orjson.loads(p) for out in made for p in out]


def test_each_save_moves_the_expiry_deadline_and_a_prompt_removes_the_timer() -> None:
    runtime, function, timers = _opened()
    now = time.time()
    _accept(function, timers, _view("s", 1, now))
    first = expiry_deadline_ms(timers.now_ms, 3600 * 1000)
    assert timers.processing == {first} and timers.event == {FLUSH_TIMER_TS}
    assert first == timers.now_ms + 3600 * 1000 - 360 * 1000  # a tenth of the TTL early, at most 10 min

    timers.now_ms += 5_000
    _accept(function, timers, _view("s", 2, now + 5))
    assert timers.processing == {first}  # one timer per shopper, not moved by each save
    raw = runtime.states["expiry_timer"].value()
    assert raw is not None and ExpiryTimer.from_state(raw) == ExpiryTimer(first, first + 5_000, 2)
    timers.now_ms = first
    assert _fire(function, timers, TimeDomain.PROCESSING_TIME, first) == []  # early: the TTL moved on
    assert timers.processing == {first + 5_000} and runtime.states["session"].value() is not None

    timers.now_ms += 1_000
    (cart,) = _accept(function, timers, _view("s", 3, now + 6, "add_to_cart"))  # none pending after it
    assert cart["new_event_ids"] == ["s-e1", "s-e2", "s-e3"]
    assert timers.processing == set() and timers.event == set()
    assert runtime.states["expiry_timer"].value() is None


def test_a_save_after_the_wall_clock_stepped_back_brings_the_timer_forward() -> None:
    assert next_expiry(ExpiryTimer(100, 100, 1), 90, 2) == ExpiryTimer(90, 90, 2)
    assert next_expiry(ExpiryTimer(100, 100, 1), 120, 2) == ExpiryTimer(100, 120, 2)
    assert next_expiry(None, 120, 1) == ExpiryTimer(120, 120, 1)


def test_at_its_expiry_timer_a_session_is_prompted_and_dropped_with_its_timers() -> None:
    runtime, function, timers = _opened()
    _accept(function, timers, _view("s", 1, time.time()), _view("s", 2, time.time() + 1))
    (deadline,) = timers.processing
    timers.now_ms = deadline

    prompts = _fire(function, timers, TimeDomain.PROCESSING_TIME, deadline)
    assert [p["new_event_ids"] for p in prompts] == [["s-e1", "s-e2"]]
    assert timers.processing == set() and timers.event == set()  # the drain timer went with the state
    assert all(state.value() is None for state in runtime.states.values())
    counters = runtime.metrics.counters
    assert counters["prompts_by_expiry"].count == counters["prompts_emitted"].count == 1


def test_a_timer_that_finds_the_state_expired_counts_what_it_held() -> None:
    """The job was down across the TTL: the session is gone when a timer fires. Its pending events are
    counted (``events_expired_unprompted``), from the expiry timer's own state, and its timers go."""
    for domain, ts in (
        (TimeDomain.EVENT_TIME, FLUSH_TIMER_TS),  # a drain reached the drain timer first
        (TimeDomain.PROCESSING_TIME, None),  # the expiry timer fired after the restore
    ):
        runtime, function, timers = _opened()
        _accept(function, timers, *(_view("s", n, time.time() + n) for n in range(3)))
        runtime.states["session"].clear()  # what the TTL does
        (deadline,) = timers.processing

        assert _fire(function, timers, domain, deadline if ts is None else ts) == []
        counters = runtime.metrics.counters
        assert counters["events_expired_unprompted"].count == 3
        assert counters["timers_found_expired_state"].count == 1
        assert timers.processing == set() and timers.event == set()
        assert runtime.states["expiry_timer"].value() is None


def test_a_drain_timer_restored_without_an_expiry_timer_is_counted() -> None:
    """A savepoint of the job before expiry timers holds drain timers of expired sessions: at a drain
    each is counted (how many events it held is not known) and goes."""
    runtime, function, timers = _opened()
    timers.register_event_time_timer(FLUSH_TIMER_TS)
    assert _fire(function, timers, TimeDomain.EVENT_TIME, FLUSH_TIMER_TS) == []
    counters = runtime.metrics.counters
    assert counters["timers_found_expired_state"].count == 1
    assert counters["events_expired_unprompted"].count == 0
