"""The two engines agree: the same Kafka records through the job submitted with ``flink run`` to the
standalone Flink cluster (at parallelism 2, a subtask on each of two TaskManagers), with its prompts
answered by the enrichment runner ``shopper flink submit`` derives from its settings (the default:
``prompts_topic``, ``devstack.enrichment_stage``), and through the embedded runner, both running at once
with their production timer settings (Flink's ``wall_clock_timers`` on, the runner's
``timer_wall_per_event_s`` 1.0) and the default overload policy (latest wins, by priority), agree on what
latest wins leaves fixed: identical Redis signals (each shopper's newest answered version, in every field
the events determine, which leaves out timings and the replica that answered), the same prompts with the
same triggers in S3 and on the insights topic, the same answer wherever both engines answered a prompt,
each engine's results passing the latest-wins oracle (``tests.helpers.assert_latest_wins``), and
identical dead letters (byte for byte, partition, offset and the size limit's cut included). Which of a
shopper's older prompts a newer one superseded depends on timing, so the split between insights and
superseded results is not compared. Stored session entries are the same bytes too: Flink's keyed state
cannot be read from Python, so that is checked on the state value the job builds
(``tests/runner/test_session_store.py``).

The records: a replayed backlog (the synthetic stream, a year old, and one shopper's 100 views 3 s
apart an hour ago, with the fractions of a millisecond of real clock values), malformed JSON, an
oversized event, non-UTF-8 bytes, a tombstone, records without a shopper id, a cart add stamped a day
ahead of its Kafka record (dead-lettered by the event-time window on both: the shopper's later cart add
is still answered), a shopper's events keyed by something else (the runner re-keys them through the
event topic, the job in its source query), and, once both engines have read the backlog, a live
shopper's views stamped ``time.time()``. Nothing drains or flushes before
the results are compared: every browse pause, the backlog's and the live one, must fire on each
engine's wall-clock timers, once per pause (a backlog that fired a prompt per event, or a pause that
never fired, shows as a missing or an extra result). The Flink job keeps running past every bad record
and spreads the records without a shopper id over both subtasks; its insights topic is keyed by
shopper, as the runner's.

Both engines call the same session processor, client, sinks and dead-letter module; this test guards the
shells and the connector path (Table API Kafka source with metadata columns, the keyed Table API insights
sink). While the job runs, the compose stack's Flink dashboard is checked against what the cluster's
Prometheus reporter and the enrichment runner's ``/metrics`` serve."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import redis as sync_redis
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.flink_cluster import FlinkClusterState, FlinkRest
from devstack.runner_thread import RunnerThread
from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from pipeline.dead_letter import DeadLetter
from prompt_assembly.events import MalformedEvent, parse_event
from shopper.readback import list_s3_records, read_topic_placed
from tests.conftest import Isolated
from tests.flink_kit import (
    cluster_job_settings,
    committed,
    drain,
    enrichment_runner,
    flink_topics,
    produce,
    read_all,
    request_ids,
    run_job,
    subtask_counters,
    wait_committed,
)
from tests.helpers import (
    assert_latest_wins,
    dashboard_metric_names,
    expected_prompts,
    prometheus_names,
    signal_versions,
)

pytestmark = [pytest.mark.flink, pytest.mark.slow]

# Fields that depend only on the events (and the deterministic stand-in model), not on timing or on
# which replica's cache happened to hold the prefix.
FLINK_DASHBOARD = Path(__file__).resolve().parents[2] / "docker/grafana/dashboards/shopper-flink.json"
"""The compose stack's Flink dashboard, checked against the metrics the standalone cluster's Prometheus
reporter serves while the job runs (the runner's dashboard has its own check)."""
FLINK_METRIC = re.compile(r"\bflink_[A-Za-z0-9_]+\b")
RUNNER_METRIC = re.compile(r"\bshopper_[A-Za-z0-9_]+\b")
"""The Flink dashboard's enrichment panels read the job's enrichment runner (its prompts topic)."""

SIGNAL_FIELDS = (
    "seq",
    "request_id",
    "summary",
    "interests",
    "occasion",
    "style",
    "price_sensitivity",
    "reason",
    "event_count",
    "last_event_ts",
    "model",
)
DLQ_MAX_ORIGINAL_BYTES = 4_096
"""Both engines' ``dlq_max_original_bytes``: under the oversized record, so both cut it the same way."""
RECORD_FIELDS = (
    "kind",
    "request_id",
    "shopper_id",
    "seq",
    "reason",
    "understanding",
    "event_count",
    "last_event_ts",
    "model",
)
"""A result's event-determined fields, for comparing engines whose results are all insights."""
TRIGGER_FIELDS = ("request_id", "shopper_id", "session_epoch", "seq", "reason", "last_event_ts")
"""What every result kind says of its prompt: the prompts and their triggers, which both engines must
emit whatever the overload policy superseded."""
ANSWER_FIELDS = (*TRIGGER_FIELDS, "kind", "understanding", "event_count", "model")
"""An insight's event-determined fields: the same wherever both engines answered the prompt."""


def signals(redis_url: str, prefix: str) -> dict[str, dict[str, str]]:
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return {
            key.removeprefix(f"{prefix}signals:"): {
                f: cast(str | None, client.hget(key, f)) or "" for f in SIGNAL_FIELDS
            }
            for key in client.scan_iter(match=f"{prefix}signals:*", count=1000)
        }
    finally:
        client.close()


def whole_records(isolated: Isolated, s3_prefix: str) -> dict[str, dict[str, Any]]:
    """S3's results under ``s3_prefix`` by request id, every field."""
    settings = isolated.sinks().model_copy(update={"s3_prefix": s3_prefix})
    _, rows = list_s3_records(settings, s3_prefix)
    return {str(r["request_id"]): r for r in rows}


def records(isolated: Isolated, s3_prefix: str) -> dict[str, dict[str, Any]]:
    """S3's results by request id, their event-determined fields."""
    return {rid: fields(r, RECORD_FIELDS) for rid, r in whole_records(isolated, s3_prefix).items()}


def whole_topic_results(bootstrap: str, topic: str, expect: int) -> dict[str, dict[str, Any]]:
    """The insights topic's results by request id, every field (one each: no duplicates)."""
    rows = [orjson.loads(value) for value in read_all(bootstrap, topic, expect=expect)]
    by_id = {str(r["request_id"]): r for r in rows}
    assert len(by_id) == len(rows), f"duplicates on {topic}"
    return by_id


def topic_results(bootstrap: str, topic: str, expect: int) -> dict[str, dict[str, Any]]:
    """The insights topic's results by request id, their event-determined fields (as for S3)."""
    return {rid: fields(r, RECORD_FIELDS) for rid, r in whole_topic_results(bootstrap, topic, expect).items()}


def fields(row: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: row.get(name) for name in names}


def assert_agree(flink: dict[str, dict[str, Any]], embedded: dict[str, dict[str, Any]], where: str) -> None:
    """Both engines' results by request id agree on what latest wins leaves fixed: the same prompts and
    triggers, and the same answer wherever both answered (which of a shopper's older prompts a newer one
    superseded depends on timing)."""
    assert {rid: fields(r, TRIGGER_FIELDS) for rid, r in flink.items()} == {
        rid: fields(r, TRIGGER_FIELDS) for rid, r in embedded.items()
    }, f"{where}: the engines emitted different prompts or triggers"
    both = [rid for rid, r in flink.items() if r["kind"] == "insight" == embedded[rid]["kind"]]
    assert both, f"{where}: no prompt answered by both engines"
    differ = [
        rid for rid in both if fields(flink[rid], ANSWER_FIELDS) != fields(embedded[rid], ANSWER_FIELDS)
    ]
    assert not differ, f"{where}: the engines answered the same prompt differently: {differ[:5]}"


def bad_records() -> list[tuple[bytes | None, bytes | None]]:
    """One of each kind the gate must reject, keyed so they land on known shoppers' partitions."""
    oversized = orjson.dumps(
        {"event_id": "big", "shopper_id": "s-big", "type": "search", "ts": 1.0, "query": "x" * 20_000}
    )
    return [
        (b"s-bad-1", b"{not json"),
        (b"s-bad-2", oversized),
        (b"s-bad-3", b"\xff\xfe\x00 not utf-8"),
        (b"s-bad-4", None),  # a tombstone
    ]


RUNNER_WALL_PER_EVENT_S = 1.0
"""The runner's production ``timer_wall_per_event_s``: a pause waits its quiet period on the wall clock."""
STORED_WITHIN_S = 240.0
"""How long each engine may take to store every expected result (the last pauses fire a quiet period
after the last events are read); a wait, not a measure: past it the test fails naming what is missing."""
BACKLOG_VIEWS, BACKLOG_GAP_S, BACKLOG_AGE_S = 100, 3.0, 3600.0
"""A replayed backlog: 100 views 3 s apart an hour ago are one browse pause (one prompt, after the last)."""
LIVE_VIEWS = 3
UNKEYED = 100
"""Records without a shopper id. Keyed by "" they all went to one subtask; spread by their position,
one subtask gets all of them but the few other bad records' worth with a chance below 1e-20."""


def product_event(kind: str, shopper: str, n: int, ts: float) -> bytes:
    product = {"product_id": f"p{n % 7}", "title": "Trail shoe", "brand": "Acme", "price": 90.0}
    return orjson.dumps(
        {"event_id": f"{shopper}-{n}", "shopper_id": shopper, "type": kind, "ts": ts, "product": product}
    )


def view(shopper: str, n: int, ts: float) -> bytes:
    return product_event("view", shopper, n, ts)


def cart_add(shopper: str, n: int, ts: float) -> bytes:
    return product_event("add_to_cart", shopper, n, ts)


def backlog_views(shopper: str) -> list[tuple[bytes | None, bytes | None]]:
    start = time.time() - BACKLOG_AGE_S
    return [(shopper.encode(), view(shopper, n, start + n * BACKLOG_GAP_S)) for n in range(BACKLOG_VIEWS)]


FUTURE_AHEAD_S = 86_400.0
"""A device clock a day ahead: far past the event-time window's ``max_ahead_s``."""


def future_stamped_records() -> list[tuple[bytes | None, bytes | None]]:
    """A cart add stamped a day ahead, then the same shopper's cart add stamped now: the first is
    dead-lettered, and the second is answered (a future time no longer silences the shopper)."""
    now = time.time()
    return [
        (b"s-future", cart_add("s-future", 0, now + FUTURE_AHEAD_S)),
        (b"s-future", cart_add("s-future", 1, now)),
    ]


def miskeyed_records() -> list[tuple[bytes | None, bytes | None]]:
    """A shopper's views and cart add, each keyed by another shopper's id (a producer keying by session)."""
    start = time.time() - BACKLOG_AGE_S / 2
    shopper = "s-miskeyed"
    events = [view(shopper, 0, start), view(shopper, 1, start + 1), cart_add(shopper, 2, start + 2)]
    return [(b"s-other", event) for event in events]


def unkeyed_records() -> list[tuple[bytes | None, bytes | None]]:
    """Events that lack a shopper id, produced without a key."""
    return [
        (None, orjson.dumps({"event_id": f"u{n}", "type": "search", "ts": time.time(), "query": "hat"}))
        for n in range(UNKEYED)
    ]


def wait_stored(isolated: Isolated, s3_prefix: str, expected: set[str], runner: RunnerThread) -> None:
    """Until S3 under ``s3_prefix`` holds a result for every expected prompt (and no other)."""
    deadline = time.monotonic() + STORED_WITHIN_S
    found: set[str] = set()
    while time.monotonic() < deadline:
        assert runner.error is None, runner.error
        found = set(records(isolated, s3_prefix))
        assert found <= expected, (
            f"{s3_prefix}: results no prompt should have: {sorted(found - expected)[:5]}"
        )
        if found == expected:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{s3_prefix}: results never stored for {sorted(expected - found)[:10]}")


def wait_dead_lettered_on_every_subtask(rest: FlinkRest, job_id: str, dead: int) -> list[int]:
    """The session stage's per-subtask dead-letter counts, once they add up to ``dead``."""
    deadline = time.monotonic() + STORED_WITHIN_S
    counts: list[int] = []
    while time.monotonic() < deadline:
        counts = subtask_counters(rest, job_id, "shopper sessions", "shopper.events_dlq")
        if sum(counts) >= dead:
            return counts
        time.sleep(1.0)
    raise TimeoutError(f"the session stage reported {counts} dead letters, {dead} expected")


def test_flink_cluster_and_embedded_runner_write_the_same_results(
    isolated: Isolated, stack: StackState, stack_dir: Path, flink_cluster: FlinkClusterState
) -> None:
    stream = SyntheticStream(shoppers=20, seed=99, malformed_rate=0.02).take(300)
    records_in: list[tuple[bytes | None, bytes | None]] = [(k, v) for k, v, _ in stream]
    bad = bad_records()
    records_in[100:100] = bad[:2]
    records_in[200:200] = bad[2:]
    backlog = backlog_views("s-backlog")
    records_in += backlog + unkeyed_records() + future_stamped_records() + miskeyed_records()

    topics = flink_topics(isolated)
    flink_prefix, flink_s3 = f"{isolated.prefix}flink:", f"{isolated.s3_prefix}-flink"
    # Each engine's S3 objects, listed under "{prefix}/": "test-x" alone also lists "test-x-flink/".
    flink_objects, runner_objects = f"{flink_s3}/", f"{isolated.s3_prefix}/"
    settings = cluster_job_settings(
        stack, stack_dir, isolated, topics, prefix=flink_prefix, s3_prefix=flink_s3
    ).model_copy(update={"dlq_max_original_bytes": DLQ_MAX_ORIGINAL_BYTES, "parallelism": 2})
    assert settings.wall_clock_timers, "the job must run with its production timers"
    # The runner's insights topic with as many partitions as the job's: both engines place a shopper's
    # results on the same one.
    runner_insights = f"runner-{topics.insights}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    partitions = admin.list_topics(topics.insights, timeout=10).topics[topics.insights].partitions
    for future in admin.create_topics([NewTopic(runner_insights, len(partitions), 1)]).values():
        future.result(timeout=10)
    runner_settings = isolated.runner(
        sinks=isolated.sinks().model_copy(update={"insights_topic": runner_insights}),
        dlq_max_original_bytes=DLQ_MAX_ORIGINAL_BYTES,
        until_drained=False,
        timer_wall_per_event_s=RUNNER_WALL_PER_EVENT_S,
    )
    runner = RunnerThread(runner_settings).start()
    try:
        with enrichment_runner(isolated, settings, metrics_port=0) as enrich:
            ends = produce(stack.kafka_bootstrap, isolated.topic, records_in)
            job = run_job(flink_cluster, settings, stack_dir)
            rest = FlinkRest(flink_cluster.web_url)
            wait_committed(stack.kafka_bootstrap, topics.group, topics.events, ends, rest, job.job_id)
            wait_runner_committed(stack.kafka_bootstrap, isolated.group, isolated.topic, ends, runner)
            # The backlog is read; a live shopper browses now and pauses.
            live_at = time.time()
            live: list[tuple[bytes | None, bytes | None]] = [
                (b"s-live", view("s-live", n, live_at + n / 1000)) for n in range(LIVE_VIEWS)
            ]
            produce(stack.kafka_bootstrap, isolated.topic, live)
            records_in += live
            taken = [(k or b"", v, True) for k, v in records_in if v is not None and valid(v)]
            expected = expected_prompts(taken)
            backlog_prompts = [p for p in expected.values() if p.shopper_id == "s-backlog"]
            assert [(p.reason, p.last_event_ts) for p in backlog_prompts] == [
                ("browse_pause", orjson.loads(backlog[-1][1] or b"{}")["ts"])
            ], "the backlog is one browse pause, after its last view"
            assert [p.reason for p in expected.values() if p.shopper_id == "s-live"] == ["browse_pause"]
            assert [p.reason for p in expected.values() if p.shopper_id == "s-future"] == ["add_to_cart"]
            assert "add_to_cart" in [p.reason for p in expected.values() if p.shopper_id == "s-miskeyed"]
            # Neither engine is drained or flushed before this: only their timers can fire the pauses.
            wait_stored(isolated, flink_objects, set(expected), enrich)
            wait_stored(isolated, runner_objects, set(expected), runner)

            assert rest.job_state(job.job_id) == "RUNNING", "the job stopped on a bad record"
            n_bad = sum(1 for _, v in records_in if v is None or not valid(v))
            per_subtask = wait_dead_lettered_on_every_subtask(rest, job.job_id, n_bad)
            n_unkeyed = sum(1 for _, v in records_in if shopper_id_of(v) is None)
            assert max(per_subtask) < n_unkeyed, (
                f"{n_unkeyed} records without a shopper id all went to one subtask: {per_subtask}"
            )
            exported = prometheus_names(flink_cluster.metrics_urls)
            asked = dashboard_metric_names(FLINK_DASHBOARD, FLINK_METRIC)
            shown = sorted(n for n in exported if any(w in n for w in ("shopper", "Checkpoint", "Restart")))
            assert asked <= exported, (
                "the Flink dashboard asks for metrics the cluster does not export: "
                f"{sorted(asked - exported)}; exported: {shown}"
            )
            assert enrich.runner.ops is not None, "the enrichment runner serves /metrics"
            enrichment_exports = prometheus_names([f"{enrich.runner.ops.address}/metrics"])
            asked_of_runner = dashboard_metric_names(FLINK_DASHBOARD, RUNNER_METRIC)
            assert asked_of_runner and asked_of_runner <= enrichment_exports, (
                "the Flink dashboard asks the enrichment runner for metrics it does not export: "
                f"{sorted(asked_of_runner - enrichment_exports)}"
            )
            drain(flink_cluster, job.job_id, stack_dir)
    finally:
        stats = runner.stop()
    acct = stats.accounting
    assert enrich.stats is not None
    enriched = enrich.stats.accounting
    assert enriched.balanced and enriched.dead_lettered == 0, enriched.as_dict()
    assert enriched.prompts == len(expected) == enriched.insights + enriched.errors + enriched.superseded
    assert acct.balanced and acct.prompts == len(expected) == acct.insights + acct.errors + acct.superseded

    embedded_signals = signals(stack.redis_url, isolated.prefix)
    assert len(embedded_signals) == len({p.shopper_id for p in expected.values()})
    assert signals(stack.redis_url, flink_prefix) == embedded_signals

    embedded_records = whole_records(isolated, runner_objects)
    flink_records = whole_records(isolated, flink_objects)
    for prefix, results in ((isolated.prefix, embedded_records), (flink_prefix, flink_records)):
        assert_latest_wins(expected, results.values(), signal_versions(stack.redis_url, prefix))
    assert_agree(flink_records, embedded_records, "S3")

    n_dead = stats.accounting.dead_lettered
    assert n_dead == n_bad
    embedded_dlq = sorted(read_all(stack.kafka_bootstrap, isolated.dlq_topic, expect=n_dead))
    flink_dlq = sorted(read_all(stack.kafka_bootstrap, topics.dlq, expect=n_dead))
    assert flink_dlq == embedded_dlq, "dead letters differ between the engines"
    letters = [DeadLetter.from_bytes(v) for v in flink_dlq]
    assert len(letters) == n_dead >= len(bad)
    assert any(letter.truncated for letter in letters), "the size limit cut the oversized record"

    embedded_topic = whole_topic_results(stack.kafka_bootstrap, runner_insights, len(expected))
    assert set(embedded_topic) == set(expected)
    flink_topic = whole_topic_results(stack.kafka_bootstrap, topics.insights, len(expected))
    assert_agree(flink_topic, embedded_topic, "insights topic")
    for topic, stored in ((embedded_topic, embedded_records), (flink_topic, flink_records)):
        assert {rid: fields(r, ANSWER_FIELDS) for rid, r in topic.items()} == {
            rid: fields(r, ANSWER_FIELDS) for rid, r in stored.items()
        }, "an engine's insights topic and S3 hold different results"
    assert all(d.reason and d.topic == isolated.topic for d in letters)
    assert all(d.partition is not None and d.offset is not None and d.timestamp_ms for d in letters)
    reasons = " | ".join(d.reason for d in letters)
    assert "invalid JSON" in reasons and "byte limit" in reasons and "null value" in reasons
    assert "event time" in reasons, "the future-stamped cart add was not dead-lettered for its time"
    assert any(d.original_encoding == "base64" for d in letters)

    keyed = read_topic_placed(stack.kafka_bootstrap, topics.insights, expect=len(expected))
    assert sorted(request_ids([v for _, _, v in keyed])) == sorted(expected), "insights: not one per prompt"
    assert all(key == orjson.loads(value)["shopper_id"].encode() for _, key, value in keyed), (
        "insights topic: a record not keyed by its shopper"
    )
    runner_placed = read_topic_placed(stack.kafka_bootstrap, runner_insights, expect=len(expected))
    placement = {str(orjson.loads(value)["request_id"]): partition for partition, _, value in runner_placed}
    assert {str(orjson.loads(v)["request_id"]): p for p, _, v in keyed} == placement, (
        "the engines put a shopper's results on different partitions"
    )
    assert len(set(placement.values())) > 1, "every result on one partition: placement not shown"


def wait_runner_committed(
    bootstrap: str, group: str, topic: str, ends: dict[int, int], runner: RunnerThread
) -> None:
    """Until the runner's group has committed every produced record."""
    deadline = time.monotonic() + STORED_WITHIN_S
    seen: dict[int, int] = {}
    while time.monotonic() < deadline:
        assert runner.error is None, runner.error
        seen = committed(bootstrap, group, topic, sorted(ends))
        if all(seen.get(p, -1) >= end for p, end in ends.items()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"runner group {group} committed {seen}, produced up to {ends}")


def valid(value: bytes) -> bool:
    """Whether the gate takes ``value`` from a record stamped now (each record here is produced now)."""
    try:
        parse_event(value, record_time=time.time())
    except MalformedEvent:
        return False
    return True


def shopper_id_of(value: bytes | None) -> str | None:
    """The ``shopper_id`` the job's source query reads from a record, None where it has none."""
    try:
        data = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    found = data.get("shopper_id") if isinstance(data, dict) else None
    return found if isinstance(found, str) and found else None
