"""The two engines agree when a shopper's session state is lost mid-stream: the reset is counted, the
newer session's answer replaces the lost one's in Redis, and every event and prompt is accounted for.

How the state is lost, on each engine as it happens in production:

- the Flink job is stopped (``flink stop``, a savepoint taken and its transactions and offsets
  committed) and submitted again *without* that savepoint: a redeploy that forgot ``-s``. It reads on
  from its group's committed offsets with empty keyed state; its enrichment runner (the default, a
  deployable of its own) runs on across the redeploy and counts the resets;
- the embedded runner is stopped, its session keys in Redis (``{prefix}session:{id}:h`` and ``:log``)
  are deleted, as their TTL would, and a new runner starts on the same group.

Both lose every shopper's session and neither loses a shopper's signal in Redis. The shoppers:

- ``s-carts``: two cart adds before the loss (versions 1 and 2), views after it: the new session's
  browse pause (its version 1, fired by the wall-clock timer) must replace version 2;
- ``s-browse``: views before the loss (a browse pause, version 1), a cart add after: the new session's
  version 1 must replace the old version 1 (same ``seq``, so only the epoch tells them apart);
- ``s-quiet``: a cart add before the loss only: its signal stays, no reset;
- ``s-new``: a cart add after the loss only: a new shopper, not a reset.

Each engine runs with the settings a user gets: Flink's ``wall_clock_timers`` on, the runner's
``timer_wall_per_event_s`` 1.0, event times from ``time.time()`` with their fractions of a millisecond.
Before the loss the events are produced a prompt at a time (each waited for on both engines), so that
no prompt can supersede another whatever the overload policy: the results are insights only.

Without session epochs (``request_id`` = ``shopper:seq``, a version that restarts with the session)
this test fails: the new session's ``s-carts`` answer (version 1) is refused by Redis below the lost
version 2, ``s-browse``'s new ``request_id`` equals the lost one (the answer ledger replays the old
answer and S3 readers drop the new one as a duplicate), and no reset is counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import pytest
import redis as sync_redis
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.runner_thread import RunnerThread
from devstack.stack import StackState
from prompt_assembly.records import PromptRequest
from runner.config import RunnerSettings
from runner.progress import RunnerStats
from sinks.keys import RedisKeys
from tests.conftest import Isolated
from tests.engines.test_engine_agreement import (
    RUNNER_WALL_PER_EVENT_S,
    cart_add,
    records,
    topic_results,
    view,
    wait_runner_committed,
    wait_stored,
)
from tests.flink_kit import (
    cluster_job_settings,
    drain,
    enrichment_runner,
    flink_topics,
    produce,
    read_all,
    run_job,
    wait_committed,
)
from tests.helpers import expected_prompts

pytestmark = [pytest.mark.flink, pytest.mark.slow]

Record = tuple[bytes | None, bytes | None]
T = TypeVar("T")

SIGNAL_FIELDS = (
    "session_epoch",
    "seq",
    "request_id",
    "resets",
    "summary",
    "interests",
    "reason",
    "event_count",
    "last_event_ts",
    "model",
)
"""The signal hash's fields that depend only on the events (and the deterministic stand-in model)."""
BEFORE_AGE_S = 600.0
"""The events before the loss are stamped from ten minutes ago (real clock values, fractions kept)."""
CART_GAP_S = 11.5
"""Event time between two cart adds: past ``min_prompt_interval_s``, so each is a prompt."""
VIEW_GAP_S = 2.3
COUNTED_WITHIN_S = 60.0
"""How long a reset counter may lag the results in S3; a wait, not a measure."""
LOST = ("s-carts", "s-browse")
"""The shoppers with events on both sides of the loss: each one reset."""


def keyed(shopper: str, value: bytes) -> Record:
    return (shopper.encode(), value)


def taken(batch: list[Record]) -> list[tuple[bytes, bytes, bool]]:
    return [(k or b"", v, True) for k, v in batch if v is not None]


def signals(redis_url: str, prefix: str) -> dict[str, dict[str, str]]:
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = RedisKeys(prefix)
        return {
            keys.shopper_of_signals(key): {
                f: cast(str | None, client.hget(key, f)) or "" for f in SIGNAL_FIELDS
            }
            for key in client.scan_iter(match=keys.signals_pattern(), count=1000)
        }
    finally:
        client.close()


def lose_runner_sessions(redis_url: str, prefix: str, shoppers: list[str]) -> int:
    """Delete the runner's stored sessions of ``shoppers`` (as their TTL would); returns keys deleted."""
    keys = RedisKeys(prefix)
    client = sync_redis.Redis.from_url(redis_url)
    try:
        names = [name for sid in shoppers for name in (keys.session_header(sid), keys.session_log(sid))]
        return cast(int, client.delete(*names))
    finally:
        client.close()


def newest(prompts: dict[str, PromptRequest]) -> dict[str, PromptRequest]:
    """Each shopper's prompt with the greatest version ``(session_epoch, seq)``."""
    found: dict[str, PromptRequest] = {}
    for prompt in prompts.values():
        held = found.get(prompt.shopper_id)
        if held is None or (prompt.session_epoch, prompt.seq) > (held.session_epoch, held.seq):
            found[prompt.shopper_id] = prompt
    return found


def wait_runner_counted(runner: RunnerThread, resets: int) -> int:
    """A runner's ``session_resets`` once it reaches ``resets`` (a result can be in S3, flushed by a
    durable point, a moment before its Redis write returns); whatever it is at the deadline otherwise.
    On Flink, the job's enrichment runner counts them: its Redis sink writes the job's results."""
    deadline = time.monotonic() + COUNTED_WITHIN_S
    counted = on_loop(runner, runner.runner.session_resets)
    while counted < resets and time.monotonic() < deadline:
        time.sleep(0.5)
        counted = on_loop(runner, runner.runner.session_resets)
    return counted


def on_loop(runner: RunnerThread, read: Callable[[], T]) -> T:
    """``read()`` on the running runner's own loop: its ``session_resets`` and ``/metrics`` are read
    while it runs (its checkpoint, which counts the resets, goes when it stops)."""
    loop = runner.runner.loop
    assert loop is not None

    async def call() -> T:
        return read()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)


def test_a_lost_session_state_resets_the_shopper_alike_on_both_engines(
    isolated: Isolated, stack: StackState, stack_dir: Path, flink_cluster: FlinkClusterState
) -> None:
    topics = flink_topics(isolated)
    flink_prefix, flink_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    # Each engine's S3 objects, listed under "{prefix}/": "test-x" alone also lists "test-x-flink/".
    flink_objects, runner_objects = f"{flink_s3}/", f"{isolated.s3_prefix}/"
    settings = cluster_job_settings(
        stack, stack_dir, isolated, topics, prefix=flink_prefix, s3_prefix=flink_s3
    ).model_copy(update={"parallelism": 2})
    assert settings.wall_clock_timers, "the job must run with its production timers"
    runner_insights = f"runner-{topics.insights}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    partitions = admin.list_topics(topics.insights, timeout=10).topics[topics.insights].partitions
    for future in admin.create_topics([NewTopic(runner_insights, len(partitions), 1)]).values():
        future.result(timeout=10)
    runner_settings: RunnerSettings = isolated.runner(
        sinks=isolated.sinks().model_copy(update={"insights_topic": runner_insights}),
        until_drained=False,
        timer_wall_per_event_s=RUNNER_WALL_PER_EVENT_S,
    )
    rest = FlinkRest(flink_cluster.web_url)
    start = time.time() - BEFORE_AGE_S
    steps: list[list[Record]] = [
        [
            keyed("s-carts", cart_add("s-carts", 0, start)),
            *(keyed("s-browse", view("s-browse", n, start + n * VIEW_GAP_S)) for n in range(3)),
            keyed("s-quiet", cart_add("s-quiet", 0, start + 1.7)),
        ],
        [keyed("s-carts", cart_add("s-carts", 1, start + CART_GAP_S))],
    ]
    before: list[Record] = []
    expected_before: dict[str, PromptRequest] = {}
    ends: dict[int, int] = {}
    runner = RunnerThread(runner_settings).start()
    stats: list[RunnerStats] = []
    try:
        with enrichment_runner(isolated, settings) as enrich:
            job = run_job(flink_cluster, settings, stack_dir)
            for step in steps:  # a prompt at a time per shopper: none can supersede another
                for partition, end in produce(stack.kafka_bootstrap, isolated.topic, step).items():
                    ends[partition] = max(ends.get(partition, 0), end)
                before += step
                expected_before = expected_prompts(taken(before))
                wait_stored(isolated, flink_objects, set(expected_before), enrich)
                wait_stored(isolated, runner_objects, set(expected_before), runner)
            assert [p.seq for p in expected_before.values() if p.shopper_id == "s-carts"] == [1, 2]
            wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
            wait_runner_committed(stack.kafka_bootstrap, isolated.group, isolated.topic, ends, runner)
            assert on_loop(runner, runner.runner.session_resets) == 0

            # The loss. Flink: stopped and submitted again without its savepoint. The runner: stopped, its
            # stored sessions gone, started again.
            rest.stop_with_savepoint(
                job.job_id, (stack_dir / "flink" / "savepoints").resolve().as_uri(), drain=False
            )
            rest.wait_for_state(job.job_id, {"FINISHED"})
            stats.append(runner.stop())
            shoppers = sorted({p.shopper_id for p in expected_before.values()})
            assert lose_runner_sessions(stack.redis_url, isolated.prefix, shoppers) == 2 * len(shoppers)
            job = run_job(flink_cluster, settings, stack_dir)
            runner = RunnerThread(runner_settings).start()

            now = time.time()
            after: list[Record] = [
                *(keyed("s-carts", view("s-carts", 10 + n, now + n * VIEW_GAP_S / 1000)) for n in range(3)),
                keyed("s-browse", cart_add("s-browse", 10, now + 0.0137)),
                keyed("s-new", cart_add("s-new", 0, now + 0.0213)),
            ]
            for partition, end in produce(stack.kafka_bootstrap, isolated.topic, after).items():
                ends[partition] = max(ends.get(partition, 0), end)
            # The new sessions start from the first event after the loss: the oracle sees them alone.
            expected_after = expected_prompts(taken(after))
            expected = {**expected_before, **expected_after}
            assert [p.reason for p in expected_after.values() if p.shopper_id == "s-carts"] == [
                "browse_pause"
            ]
            # Neither engine is drained before this: the new browse pause fires on the wall clock.
            wait_stored(isolated, flink_objects, set(expected), enrich)
            wait_stored(isolated, runner_objects, set(expected), runner)
            wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
            wait_runner_committed(stack.kafka_bootstrap, isolated.group, isolated.topic, ends, runner)

            flink_resets = wait_runner_counted(enrich, len(LOST))
            embedded_resets = wait_runner_counted(runner, len(LOST))
            exposition = on_loop(runner, runner.runner.metrics.exposition).decode()
            drain(flink_cluster, job.job_id, stack_dir)
    finally:
        stats.append(runner.stop())

    # The newer session's answer holds each lost shopper's signal; the others are untouched.
    embedded_signals = signals(stack.redis_url, isolated.prefix)
    flink_signals = signals(stack.redis_url, flink_prefix)
    assert flink_signals == embedded_signals, f"signals: Flink {flink_signals}, runner {embedded_signals}"

    # The reset is counted, once per lost shopper, by each engine's Redis sink.
    assert flink_resets == len(LOST), (
        f"Flink's (its enrichment runner's) session_resets; signals {flink_signals}"
    )
    assert embedded_resets == len(LOST), f"the runner's session_resets; signals {embedded_signals}"
    assert f"shopper_session_resets_total {float(len(LOST))}" in exposition
    want = newest(expected)
    assert {sid: s["request_id"] for sid, s in embedded_signals.items()} == {
        sid: p.request_id for sid, p in want.items()
    }
    for sid in LOST:
        old = newest(expected_before)[sid]
        held = embedded_signals[sid]
        assert int(held["session_epoch"]) > old.session_epoch, f"{sid}: the lost session's epoch held"
        assert (held["seq"], held["resets"]) == ("1", "1"), f"{sid}: {held}"
    assert int(newest(expected_before)["s-carts"].seq) > int(embedded_signals["s-carts"]["seq"])
    assert {embedded_signals[sid]["resets"] for sid in ("s-quiet", "s-new")} == {"0"}

    assert len(expected) == len(expected_before) + len(expected_after), "a request_id reused"

    # Nothing unaccounted: every event applied, every prompt one stored insight, the same on both.
    assert all(s.accounting.balanced for s in stats), [s.accounting for s in stats]
    assert sum(s.accounting.accepted for s in stats) == len(before) + len(after)
    assert sum(s.accounting.insights for s in stats) == len(expected)
    assert sum(s.accounting.dead_lettered + s.accounting.duplicates for s in stats) == 0
    embedded_records = records(isolated, runner_objects)
    assert set(embedded_records) == set(expected)
    assert {r["kind"] for r in embedded_records.values()} == {"insight"}
    assert records(isolated, flink_objects) == embedded_records
    embedded_topic = topic_results(stack.kafka_bootstrap, runner_insights, len(expected))
    assert set(embedded_topic) == set(expected)
    assert topic_results(stack.kafka_bootstrap, topics.insights, len(expected)) == embedded_topic
    assert read_all(stack.kafka_bootstrap, topics.dlq) == []
