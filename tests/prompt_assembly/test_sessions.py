"""Sessions, triggers and prefix-stable prompts: plain unit tests and hypothesis properties."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_assembly.events import ShopperEvent
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import PromptRequest
from prompt_assembly.session import ShopperSession
from prompt_assembly.tokens import messages_text, token_ids
from prompt_assembly.triggers import TriggerPolicy

_counter = iter(range(10**9))


def event(
    kind: str = "view",
    ts: float = 1000.0,
    shopper: str = "s1",
    event_id: str | None = None,
    title: str = "Witch Hat",
) -> ShopperEvent:
    eid = event_id or f"e{next(_counter)}"
    if kind == "search":
        return ShopperEvent(event_id=eid, shopper_id=shopper, type="search", ts=ts, query=title)
    return ShopperEvent(
        event_id=eid,
        shopper_id=shopper,
        type=kind,
        ts=ts,
        product={
            "product_id": "p1",
            "title": title,
            "category": "Costumes",
            "price": 19.5,
            "snippet": "Kids loved it",
        },
    )


def shared_tokens(a: PromptRequest, b: PromptRequest) -> int:
    ids_a, ids_b = token_ids(messages_text(a.messages)), token_ids(messages_text(b.messages))
    n = 0
    for x, y in zip(ids_a, ids_b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_cart_add_triggers_at_once_and_browsing_after_a_quiet_period() -> None:
    processor = SessionProcessor(
        SessionConfig(triggers=TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=5))
    )
    session = processor.new_session("s1")
    assert processor.apply(session, event("view", 100)).prompts == []
    assert processor.apply(session, event("view", 110)).prompts == []  # still browsing
    cart = processor.apply(session, event("add_to_cart", 112)).prompts
    assert [p.reason for p in cart] == ["add_to_cart"]
    assert processor.apply(session, event("view", 113)).prompts == []
    # The next event comes after the quiet period: the browse-pause prompt fires first, without it.
    later = processor.apply(session, event("view", 200)).prompts
    assert [p.reason for p in later] == ["browse_pause"] and later[0].event_count == 4


def test_rate_limit_defers_a_cart_add_and_keeps_its_reason() -> None:
    processor = SessionProcessor(
        SessionConfig(triggers=TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=10))
    )
    session = processor.new_session("s1")
    assert len(processor.apply(session, event("add_to_cart", 100)).prompts) == 1
    assert processor.apply(session, event("add_to_cart", 103)).prompts == []  # rate-limited
    assert (
        session.pending is not None
        and session.pending.due_ts == 110
        and session.pending.reason == "add_to_cart"
    )
    assert processor.apply(session, event("view", 105)).prompts == []  # browsing keeps the cart trigger
    assert session.pending.reason == "add_to_cart"
    fired = processor.fire_pending(session, due_ts=110)
    assert [p.reason for p in fired] == ["add_to_cart"] and session.pending is None


def test_a_prompt_says_when_it_became_due_whoever_fired_it() -> None:
    """``due_ts`` is the event time a prompt became due: the triggering event's, or the pending
    trigger's due time whether its timer fired it (late or not), a later event did, or a drain."""
    processor = SessionProcessor(
        SessionConfig(triggers=TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=10))
    )
    session = processor.new_session("s1")
    [cart] = processor.apply(session, event("add_to_cart", 100)).prompts
    assert cart.due_ts == 100
    assert processor.apply(session, event("add_to_cart", 103)).prompts == []  # rate-limited to 110
    [deferred] = processor.fire_pending(session, due_ts=111.5)  # its timer fired 1.5 s late
    assert deferred.due_ts == 110 and deferred.reason == "add_to_cart"
    processor.apply(session, event("view", 115))  # a browse pause due at 135
    [pause, cart_again] = processor.apply(session, event("add_to_cart", 150)).prompts
    assert (pause.reason, pause.due_ts) == ("browse_pause", 135)
    assert (cart_again.reason, cart_again.due_ts) == ("add_to_cart", 150)
    processor.apply(session, event("view", 160))
    [drained] = processor.flush(session)
    assert (drained.reason, drained.due_ts) == ("browse_pause", 180)


def test_stale_timer_does_not_fire_early() -> None:
    processor = SessionProcessor(SessionConfig(triggers=TriggerPolicy(quiet_period_s=20)))
    session = processor.new_session("s1")
    processor.apply(session, event("view", 100))
    processor.apply(session, event("view", 115))  # debounce moves the due time to 135
    assert processor.fire_pending(session, due_ts=120) == []
    assert len(processor.fire_pending(session, due_ts=135)) == 1


def test_an_armed_timer_fires_only_its_own_trigger() -> None:
    """The runner's stale timer entries stay queued. A browse pause's entry (due 121) must not fire
    the late cart add that replaced it (rate-limited, due 110) before that trigger's own entry: the
    runner then prompted without the events that came before it, which the Flink job's prompt (its
    stale timer deleted) held."""
    processor = SessionProcessor(
        SessionConfig(triggers=TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=10))
    )
    session = processor.new_session("s1")
    assert len(processor.apply(session, event("add_to_cart", 100)).prompts) == 1
    processor.apply(session, event("view", 101))
    assert session.pending is not None and session.pending.due_ts == 121  # the pause's entry: 121
    processor.apply(session, event("add_to_cart", 102))  # delivered late, rate-limited
    assert session.pending is not None and (session.pending.reason, session.pending.due_ts) == (
        "add_to_cart",
        110,
    )
    assert processor.fire_armed(session, due_ts=121) == [], "the pause's stale entry"
    assert processor.fire_pending(session, due_ts=121) != [], "the Flink job's rule would fire it"
    session = processor.new_session("s2")
    processor.apply(session, event("add_to_cart", 100, shopper="s2"))
    processor.apply(session, event("add_to_cart", 102, shopper="s2"))
    [fired] = processor.fire_armed(session, due_ts=110)
    assert fired.reason == "add_to_cart" and session.pending is None


def test_an_entry_armed_before_a_prompt_does_not_fire_the_next_pause_with_its_due_time() -> None:
    """A pause due at 120 fires; a late view (95) after it makes a new pause, due at 130 (its quiet
    period would end at 120, since the newest event (100) has not moved, but the rate limit counts from
    the prompt at 120; without a rate limit it is due at 120 again). An entry the runner armed for the
    first pause before it fired (a second arm, by the late view before the fire) popped then and fired
    the new pause at once, without its quiet period, where the Flink job, whose one timer is deleted
    when it fires, waits a whole period after the late view: the two engines made different prompts. An
    entry fires only the trigger of the prompt version it was armed under."""
    for interval, second_due in ((10.0, 130), (0.0, 120)):
        policy = TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=interval)
        processor = SessionProcessor(SessionConfig(triggers=policy))
        session = processor.new_session("s1")
        processor.apply(session, event("view", 100))
        processor.apply(session, event("view", 97))  # late: the pause stays due at 120, armed again
        armed_before = (session.epoch, session.seq)
        [first] = processor.fire_armed(session, due_ts=120, version=armed_before)
        processor.apply(session, event("view", 95))  # late again, after the fire
        assert session.pending is not None and session.pending.due_ts == second_due
        assert processor.fire_armed(session, due_ts=120, version=armed_before) == [], "armed before the fire"
        [second] = processor.fire_armed(session, due_ts=second_due, version=(session.epoch, session.seq))
        assert (first.seq, second.seq) == (1, 2)


def test_a_late_browse_event_never_brings_the_pause_forward() -> None:
    """Views at t and t+gap, then one from before t arrives late: the browse pause still waits a whole
    quiet period after t+gap, and the shopper's next event inside that period fires nothing."""
    policy = TriggerPolicy()
    quiet, gap = policy.quiet_period_s, policy.quiet_period_s / 2
    processor = SessionProcessor(SessionConfig(triggers=policy))
    session = processor.new_session("s1")
    start = 1000.0
    processor.apply(session, event("view", start))
    processor.apply(session, event("view", start + gap))
    processor.apply(session, event("click", start - gap))  # late
    assert session.pending is not None and session.pending.due_ts == start + gap + quiet
    assert processor.fire_pending(session, due_ts=start - gap + quiet) == []
    inside = start + gap + quiet / 2
    assert processor.apply(session, event("view", inside)).prompts == []


def test_late_events_that_trim_the_newest_one_never_bring_the_pause_forward() -> None:
    """The log is ordered by segment first: late views, arriving after a cart add was prompted, can
    push the newest event out of a small log. The pause was then counted from the newest event left,
    and fired a quiet period early (its prompt older than the one before it); a restored session must
    count from the same instant as the one held in memory."""
    policy = TriggerPolicy()
    quiet = policy.quiet_period_s
    processor = SessionProcessor(SessionConfig(max_events=4, trim_to_fraction=0.5, triggers=policy))
    session = processor.new_session("s1")
    processor.apply(session, event("view", 1000.0))
    (cart,) = processor.apply(session, event("add_to_cart", 1005.0)).prompts
    for ts in (900.0, 901.0, 902.0):  # late: a device's offline batch
        processor.apply(session, event("view", ts))
    assert all(e.event.ts < 1005.0 for e in session.entries), "the trim took the newest event"
    assert session.pending is not None and session.pending.due_ts == 1005.0 + quiet
    restored = ShopperSession.from_json(session.to_json())
    for held in (session, restored):
        assert processor.fire_pending(held, due_ts=902.0 + quiet) == []
        (pause,) = processor.fire_pending(held, due_ts=1005.0 + quiet)
        assert pause.last_event_ts >= cart.last_event_ts


def test_duplicates_are_ignored_and_reported() -> None:
    processor = SessionProcessor()
    session = processor.new_session("s1")
    first = event("view", 100, event_id="same")
    assert processor.apply(session, first).outcome == "accepted"
    assert processor.apply(session, first).outcome == "duplicate"
    assert len(session.entries) == 1


def test_late_event_never_moves_prompted_entries() -> None:
    processor = SessionProcessor(SessionConfig(triggers=TriggerPolicy(min_prompt_interval_s=0)))
    session = processor.new_session("s1")
    processor.apply(session, event("view", 100, title="A"))
    processor.apply(session, event("add_to_cart", 110, title="B"))  # prompt 1 holds A, B
    processor.apply(session, event("view", 130, title="D"))
    processor.apply(session, event("view", 105, title="C-late"))  # older than everything
    titles = [e.event.product.title for e in session.entries if e.event.product]
    assert titles == ["A", "B", "C-late", "D"]  # after the prompted part, then by event time


def test_session_round_trips_through_json_and_deltas() -> None:
    processor = SessionProcessor()
    session = processor.new_session("s1")
    for i in range(30):
        processor.apply(session, event("add_to_cart" if i % 7 == 0 else "view", 100 + i * 3))
    restored = ShopperSession.from_json(session.to_json())
    assert restored.header() == session.header()
    assert [e.event for e in restored.entries] == [e.event for e in session.entries]
    changes = session.take_changes()
    rebuilt = ShopperSession.restore(changes.header, [e.to_json() for e in reversed(changes.appended)])
    assert [e.event for e in rebuilt.entries] == [e.event for e in session.entries]


def test_budget_trims_in_large_steps_and_remembers_trimmed_ids() -> None:
    config = SessionConfig(
        max_log_tokens=400, trim_to_fraction=0.4, triggers=TriggerPolicy(min_prompt_interval_s=0)
    )
    processor = SessionProcessor(config)
    session = processor.new_session("s1")
    first = event("view", 100, event_id="first")
    processor.apply(session, first)
    trims, prompts = 0, []
    for i in range(120):
        before = len(session.entries)
        prompts += processor.apply(session, event("add_to_cart", 101 + i)).prompts
        if len(session.entries) < before:
            trims += 1
    assert all(p.prompt_tokens < 400 + 900 for p in prompts)  # log budget + fixed head
    assert 0 < trims < 120 / 5, "trims must be rare: each drops many events"
    assert processor.apply(session, first).outcome == "duplicate"  # trimmed, still deduplicated


def test_a_session_held_in_memory_forgets_the_ids_a_restored_one_forgets() -> None:
    """Past ``remember_trimmed_ids``, a trimmed event's id is forgotten: by a session restored from
    its stored header (the Flink job's, every event) and by the one the runner holds in memory alike.
    The held one kept every id it had seen, so a replayed old event was a duplicate on one engine and
    a new event on the other, and the held set grew for as long as the shopper browsed."""
    processor = SessionProcessor(SessionConfig(max_events=40, trim_to_fraction=0.5, remember_trimmed_ids=30))
    held = processor.new_session("s1")
    for i in range(400):
        processor.apply(held, event("view", 100 + i, event_id=f"v{i}"))
    restored = ShopperSession.from_json(held.to_json())
    for i in range(400):
        assert held.has_seen(f"v{i}") == restored.has_seen(f"v{i}"), f"v{i}"
    assert not held.has_seen("v0") and held.has_seen("v399")
    assert len(held._ids) <= 40 + 30


def test_an_epochs_saved_header_is_the_session_as_the_epoch_closed() -> None:
    """The runner takes an epoch's changes as it closes and saves them once the epoch is durable. The
    header handed out then held the session's own list of trimmed ids, which later trims went on
    filling: a restore from that save, replaying the later events, trimmed them again and its next
    prompt named them twice."""
    processor = SessionProcessor(SessionConfig(max_events=4, trim_to_fraction=0.5))
    held = processor.new_session("s1")
    for i in range(5):
        processor.apply(held, event("view", 1000.0 + i, event_id=f"x{i}"))
    closed = held.take_changes()
    taken = list(closed.header["unprompted_trimmed_ids"])
    later = [event("view", 1005.0 + i, event_id=f"x{i + 5}") for i in range(3)]
    for e in later:
        processor.apply(held, e)
    assert closed.header["unprompted_trimmed_ids"] == taken, "the header as the epoch closed"
    assert closed.rewrite is not None
    restored = ShopperSession.restore(closed.header, [entry.to_json() for entry in closed.rewrite])
    for e in later:  # the replay after a crash
        processor.apply(restored, e)
    (after_replay,) = processor.flush(restored)
    (without_crash,) = processor.flush(held)
    assert after_replay.trimmed_event_ids == without_crash.trimmed_event_ids
    assert len(set(after_replay.trimmed_event_ids)) == len(after_replay.trimmed_event_ids)


kinds = st.sampled_from(["view", "view", "view", "click", "search", "add_to_cart", "purchase"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(kinds, st.floats(0.5, 400.0)), min_size=2, max_size=60))
def test_prompts_are_prefix_stable_and_the_estimate_is_exact(steps: list[tuple[str, float]]) -> None:
    """Each prompt shares with the previous one exactly the estimated tokens, and when no trim happened
    in between that is the whole previous activity log."""
    processor = SessionProcessor(SessionConfig(max_log_tokens=1500, trim_to_fraction=0.4))
    session = processor.new_session("s1")
    ts = 1_000_000.0
    prompts: list[PromptRequest] = []
    for kind, gap in steps:
        ts += gap
        prompts += processor.apply(session, event(kind, ts, title=f"Item {int(gap)}")).prompts
    prompts += processor.flush(session)
    for earlier, later in itertools.pairwise(prompts):
        assert later.seq == earlier.seq + 1
        actual = shared_tokens(earlier, later)
        assert later.shared_prefix_tokens <= actual
        log = earlier.messages[1]["content"].rsplit("Task:", 1)[0]
        if later.messages[1]["content"].startswith(log):  # no trim in between: the estimate is exact
            assert actual - later.shared_prefix_tokens <= 2  # framing tokens around the estimate
        # After a trim only the fixed head is claimed; a log of identical lines (the same product viewed
        # again and again within a minute) can share more with the trimmed one by coincidence.
        if later.shared_prefix_tokens > 0.5 * earlier.prompt_tokens:
            assert later.messages[1]["content"].startswith(log)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(kinds, st.floats(-30.0, 60.0), st.booleans()), min_size=1, max_size=80))
def test_every_event_is_in_the_session_or_a_duplicate(steps: list[tuple[str, float, bool]]) -> None:
    processor = SessionProcessor(SessionConfig(max_events=40, trim_to_fraction=0.5))
    session = processor.new_session("s1")
    seen: list[ShopperEvent] = []
    ts = 1_000_000.0
    accepted = duplicates = 0
    for kind, gap, repeat in steps:
        ts += gap
        ev = seen[-1] if repeat and seen else event(kind, max(1.0, ts))
        outcome = processor.apply(session, ev).outcome
        accepted += outcome == "accepted"
        duplicates += outcome == "duplicate"
        seen.append(ev)
    assert accepted + duplicates == len(steps)
    assert accepted == len({e.event_id for e in seen})
    kept = {e.event.event_id for e in session.entries}
    trimmed = set(session.trimmed_ids)  # all of them: fewer than remember_trimmed_ids here
    assert kept.isdisjoint(trimmed)
    assert kept | trimmed == {e.event_id for e in seen}
    assert all(session.has_seen(ev.event_id) for ev in seen)


gaps = st.one_of(st.floats(0.1, 2.0), st.floats(20.0, 40.0))
"""Mostly a burst (no pause fires), now and then a pause."""


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(kinds, gaps), min_size=40, max_size=160),
    st.integers(0, 159),
    st.sampled_from([(8, 4000), (400, 200)]),
)
def test_every_event_is_named_by_one_prompt_as_new_or_as_trimmed(
    steps: list[tuple[str, float]], restore_at: int, budgets: tuple[int, int]
) -> None:
    """An event the log trims before any prompt took it (by the event or the token budget) is named by
    the next prompt's ``trimmed_event_ids``, across a restore from the stored session: so over a
    session's prompts every accepted event is named exactly once, and none is lost without a trace."""
    max_events, max_log_tokens = budgets
    config = SessionConfig(max_events=max_events, max_log_tokens=max_log_tokens, trim_to_fraction=0.5)
    processor = SessionProcessor(config)
    session = processor.new_session("s1")
    ts, accepted, prompts = 1_000_000.0, [], []
    for n, (kind, gap) in enumerate(steps):
        if n == restore_at:
            session = ShopperSession.from_json(session.to_json())
        ts += gap
        ev = event(kind, ts, title=f"Item {n}")
        applied = processor.apply(session, ev)
        accepted.append(ev.event_id)
        prompts += applied.prompts
    prompts += processor.flush(session)
    named = [i for p in prompts for i in [*p.new_event_ids, *p.trimmed_event_ids]]
    assert sorted(named) == sorted(accepted), "every event named once, as prompted or as trimmed"
    assert all(p.trimmed_events == len(p.trimmed_event_ids) for p in prompts)  # under the id bound here


def test_a_burst_over_the_budget_is_named_as_trimmed_by_the_next_prompt() -> None:
    processor = SessionProcessor(SessionConfig(max_events=30, trim_to_fraction=0.5))
    session = processor.new_session("s1")
    burst = [event("view", 1000 + n / 10) for n in range(40)]  # 40 views, no pause between them
    prompts = [p for ev in burst for p in processor.apply(session, ev).prompts] + processor.flush(session)
    (prompt,) = prompts
    assert prompt.trimmed_events == len(prompt.trimmed_event_ids) > 0
    assert prompt.trimmed_event_ids + prompt.new_event_ids == [ev.event_id for ev in burst]


def test_the_rate_limit_counts_from_when_the_last_prompt_became_due() -> None:
    """At most one prompt per ``min_prompt_interval_s``: a cart add held back by the limit and fired at
    110 holds the next one to 120. Counted from the newest event the held prompt took (103), the cart
    add at 114 prompted 4 s after it, and cart adds 5.5 s apart were prompted every 5.5 s."""
    processor = SessionProcessor(
        SessionConfig(triggers=TriggerPolicy(quiet_period_s=20, min_prompt_interval_s=10))
    )
    session = processor.new_session("s1")
    assert len(processor.apply(session, event("add_to_cart", 100)).prompts) == 1
    assert processor.apply(session, event("add_to_cart", 103)).prompts == []
    [held] = processor.fire_pending(session, due_ts=110)
    assert held.due_ts == 110
    assert processor.apply(session, event("add_to_cart", 114)).prompts == []
    assert session.pending is not None and session.pending.due_ts == 120
    steady = processor.new_session("s2")
    dues = []
    for i in range(8):
        ts = 200 + 5.5 * i
        fired = processor.fire_pending(steady, due_ts=ts)  # its timer, before the next event
        fired += processor.apply(steady, event("add_to_cart", ts, shopper="s2")).prompts
        dues += [prompt.due_ts for prompt in fired]
    assert all(later - earlier >= 10 for earlier, later in itertools.pairwise(dues)), dues
