"""The session function's pause timers (``flink_jobs.pause_timers``) with the shared processor: a timer
fires the trigger it was armed for whatever the fractions of a millisecond in real ``time.time()``
values, and a backlog replayed faster than its quiet periods arms one timer that fires once, as the
embedded runner's relative deadline does. The same on the Flink cluster: tests/engines."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from flink_jobs.pause_timers import ArmedTimer, due_to_fire, rearm, restored_deadline_ms, wall_deadline_ms
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.session import ShopperSession

NOW = 1_764_000_000.0
"""About the time these tests were written: real clock values, with fractions of a millisecond."""


def _view(n: int, ts: float) -> bytes:
    product = {"product_id": f"p{n}", "title": "Trail shoe", "price": 90.0}
    return orjson.dumps(
        {"event_id": f"e{n}", "shopper_id": "s", "type": "view", "ts": ts, "product": product}
    )


def _arm(session: ShopperSession, now_ms: int, before: ArmedTimer | None) -> ArmedTimer:
    assert session.pending is not None
    deadline = wall_deadline_ms(now_ms, session.pending.due_ts, session.last_event_ts)
    return rearm(before, session.pending.due_ts, deadline, now_ms).armed


@given(st.floats(min_value=NOW, max_value=NOW + 86_400, allow_nan=False))
def test_a_timer_fires_the_pause_it_was_armed_for_at_any_clock_value(ts: float) -> None:
    processor = SessionProcessor()
    session = processor.new_session("s")
    processor.apply(session, parse_event(_view(0, ts)))
    armed = _arm(session, int(ts * 1000), None)
    due = due_to_fire(armed, armed.fires_at_ms, 0)
    assert due is not None
    prompts = processor.fire_pending(session, due)
    assert [p.reason for p in prompts] == ["browse_pause"]
    assert ArmedTimer.from_state(armed.to_state()) == armed


def test_the_deadline_never_comes_before_the_quiet_period() -> None:
    quiet = SessionProcessor().config.triggers.quiet_period_s
    for fraction in (0.0, 0.0001, 0.0004, 0.9999):
        deadline = wall_deadline_ms(1_000, NOW + fraction + quiet, NOW + fraction)
        assert deadline >= 1_000 + quiet * 1000
    # A wait of a fraction of a millisecond rounds up to the next millisecond, never down to none.
    assert wall_deadline_ms(0, NOW + 0.0004, NOW) == 1
    assert wall_deadline_ms(5, NOW + 1.0004, NOW) == 5 + 1_001


def test_a_backlog_read_faster_than_its_pauses_fires_once() -> None:
    """100 views 3 s apart an hour ago, read 1 ms apart: every event moves the one timer, the last one
    fires a single prompt, the session's first, up to the last event (arming at the event-time due
    time fired up to 100). How many of the 100 lines it carries is the log budget's business."""
    processor = SessionProcessor()
    session = processor.new_session("s")
    start, read_at_ms = NOW - 3600 + 0.000_37, int(NOW * 1000)
    armed: ArmedTimer | None = None
    fired: list[int] = []
    for n in range(100):
        now_ms = read_at_ms + n
        if armed is not None and armed.fires_at_ms <= now_ms:  # a timer due before this event is read
            due = due_to_fire(armed, armed.fires_at_ms, 0)
            fired += [len(p.messages) for p in processor.fire_pending(session, due or 0.0)]
        processor.apply(session, parse_event(_view(n, start + 3 * n)))
        armed = _arm(session, now_ms, armed)
    assert armed is not None and not fired
    prompts = processor.fire_pending(session, due_to_fire(armed, armed.fires_at_ms, 0) or 0.0)
    assert [(p.reason, p.seq, p.last_event_ts) for p in prompts] == [("browse_pause", 1, start + 3 * 99)]
    assert len(prompts[0].new_event_ids) == prompts[0].event_count > 1


def test_a_timer_that_is_no_longer_current_fires_nothing() -> None:
    first = rearm(None, NOW + 20, 5_000)
    moved = rearm(first.armed, NOW + 25, 9_000)
    assert moved.delete_ms == 5_000 and moved.register_ms == 9_000
    assert due_to_fire(moved.armed, 5_000, 0) is None
    assert due_to_fire(moved.armed, 9_000, 0) == NOW + 25


def test_a_trigger_whose_due_time_stays_keeps_its_earlier_deadline() -> None:
    """A cart add waiting on the rate limit, then a view: the runner fires at the earliest deadline."""
    first = rearm(None, NOW + 10, 5_000)
    later = rearm(first.armed, NOW + 10, 7_000)
    assert later == type(later)(first.armed, None, None)
    assert rearm(first.armed, NOW + 10, 4_000).delete_ms == 5_000


def test_a_timer_armed_by_the_previous_version_still_fires_its_trigger() -> None:
    """Restored from an older savepoint: armed at the due time truncated to the millisecond."""
    processor = SessionProcessor()
    session = processor.new_session("s")
    processor.apply(session, parse_event(_view(0, NOW + 0.000_4)))
    assert session.pending is not None
    legacy_timer = int(session.pending.due_ts * 1000)
    due = due_to_fire(None, legacy_timer, 0)
    assert due is not None and len(processor.fire_pending(session, due)) == 1


def test_the_state_keeps_when_a_timer_was_armed_and_reads_the_older_form() -> None:
    armed = ArmedTimer(9_000, NOW + 20.000_37, 7_000)
    assert ArmedTimer.from_state(armed.to_state()) == armed
    assert ArmedTimer.from_state(f"9000 {NOW + 20!r}") == ArmedTimer(9_000, NOW + 20, None)


def test_only_a_timer_armed_before_the_restart_waits_its_quiet_period_after_it() -> None:
    started, wait = 100_000, 20_000
    restored = ArmedTimer(50_000, NOW + 20, 30_000)
    assert restored_deadline_ms(restored, started, started, wait) == started + wait
    assert restored_deadline_ms(restored, started + wait, started, wait) is None  # its wait is over
    older_state = ArmedTimer(50_000, NOW + 20, None)
    assert restored_deadline_ms(older_state, started + 5, started, wait) == started + wait
    assert restored_deadline_ms(ArmedTimer(120_000, NOW + 20, started), 120_000, started, wait) is None
    # Armed at the very millisecond the run started: armed in this run, so it fires now, not after a wait.
    armed_at_start = ArmedTimer(120_000, NOW + 20, started)
    assert restored_deadline_ms(armed_at_start, started + 1, started, wait) is None
    assert restored_deadline_ms(ArmedTimer(120_000, NOW + 20, started - 1), started + 1, started, wait) == (
        started + wait
    )
    assert restored_deadline_ms(restored, started, started, 0) is None  # due at once: fires at once


def test_a_restored_timer_fires_what_the_run_without_the_failure_fired() -> None:
    """The cluster case in one shopper (tests/flink_jobs/test_flink_cluster.py has it on Flink): the
    first view's pause is pending in the checkpoint, the second view comes after it, and the job is back
    only once the first pause was due. The restored timer waits its quiet period after the restart; the
    replayed second view moves it, and the one prompt has both views, as in the run without a failure
    (fired at once, the restored timer made a prompt of the first view alone as well)."""
    quiet_ms = int(SessionProcessor().config.triggers.quiet_period_s * 1000)

    def run(kill: bool) -> list[list[str]]:
        processor = SessionProcessor()
        session = processor.new_session("s")
        read_ms = int(NOW * 1000)
        processor.apply(session, parse_event(_view(1, NOW)))
        armed = _arm(session, read_ms, None)
        checkpoint = (ShopperSession.from_json(session.to_json()), armed)
        fired: list[list[str]] = []
        if kill:  # lost before the second view was read; back 30 s later, the first pause overdue
            session, armed = checkpoint
            started = read_ms + 30_000
            wait_ms = wall_deadline_ms(0, armed.due_ts, session.last_event_ts)  # as the operator does
            later = restored_deadline_ms(armed, started, started, wait_ms)
            assert later == started + quiet_ms
            armed = ArmedTimer(later, armed.due_ts, started)
            read_ms = started + 50  # the replay reads the second view
        else:
            read_ms += 2_000
        processor.apply(session, parse_event(_view(2, NOW + 2)))
        armed = _arm(session, read_ms, armed)
        due = due_to_fire(armed, armed.fires_at_ms, 0)
        assert due is not None
        fired += [p.new_event_ids for p in processor.fire_pending(session, due)]
        return fired

    assert run(kill=False) == run(kill=True) == [["e1", "e2"]]
