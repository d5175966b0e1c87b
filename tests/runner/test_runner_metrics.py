"""The runner's operations endpoint, scraped over HTTP from a real running runner (Tansu, Redis, moto,
simulator replicas): the numbers it serves agree with what the runner did, labels stay bounded, health
answers, JSON logs parse, and the Grafana dashboard in the compose stack asks only for metric names the
runner really exports."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from devstack.synthetic import SyntheticStream
from prompt_assembly.events import ProductSnapshot, ShopperEvent
from prompt_assembly.records import ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding
from runner.dead_letters import REASON_CATEGORIES, reason_category
from runner.embedded import EmbeddedRunner
from runner.logs import LogFormat, line_logger
from runner.progress import cached_lag_by_partition
from shopper.readback import list_s3_records
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated
from tests.helpers import dashboard_metric_names, expected_prompts, produce_records, unscoped_queries
from tests.runner.kit import cart_add, running

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker/grafana/dashboards/shopper-runner.json"
METRIC_NAME = re.compile(r"\bshopper_[a-z0-9_]+\b")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[Samples, set[str]]:
    """Every sample by (name, sorted labels), and every sample name exported."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, {name for name, _ in samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as response:
        return response.status, await response.text()


async def while_running(
    runner: EmbeddedRunner, ready: Callable[[], bool], check: Callable[[str], Awaitable[None]]
) -> None:
    """Run ``runner``; once ``ready()``, call ``check(address)`` against it; then stop it."""
    async with running(runner) as (task,):
        async with asyncio.timeout(120):
            while runner.ops is None or not ready():
                assert not task.done(), "the runner ended early"
                await asyncio.sleep(0.05)
            await check(runner.ops.address)


@pytest.mark.slow
def test_a_running_runner_serves_metrics_and_health_that_match_what_it_did(
    isolated: Isolated, capfd: pytest.CaptureFixture[str]
) -> None:
    records = SyntheticStream(shoppers=30, seed=91, malformed_rate=0.03).take(1200)
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    expected = expected_prompts(records)
    malformed = sum(m for *_, m in records)
    runner = EmbeddedRunner(
        isolated.runner(until_drained=False, metrics_port=0, log_format="json", progress_interval_s=0.5)
    )
    acct = runner.stats.accounting
    scraped: dict[str, Any] = {}

    def all_done() -> bool:  # everything consumed and stored (pending triggers wait: not drained)
        return (
            acct.consumed == len(records)
            and runner.in_flight == 0
            and acct.prompts > 0
            and (runner.stats.last_commit_at is not None and not runner.epochs)
        )

    async def check(address: str) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(1.0)  # one more commit interval: the final offsets are committed
            scraped["metrics"] = await get(session, f"{address}/metrics")
            scraped["ready"] = await get(session, f"{address}/health/ready")
            scraped["live"] = await get(session, f"{address}/health/live")
            scraped["health"] = await get(session, f"{address}/health")
            scraped["missing"] = await get(session, f"{address}/nothing-here")

    asyncio.run(while_running(runner, all_done, check))

    status, text = scraped["metrics"]
    assert status == 200
    samples, _ = parse(text)
    assert value(samples, "shopper_events_in_total") == len(records)
    assert value(samples, "shopper_events_valid_total") == len(records) - malformed
    by_reason = {r: value(samples, "shopper_events_dlq_total", reason=r) for r in REASON_CATEGORIES}
    assert sum(by_reason.values()) == malformed
    dlq_labels = {dict(labels)["reason"] for name, labels in samples if name == "shopper_events_dlq_total"}
    assert dlq_labels == set(REASON_CATEGORIES), "the reason label has exactly the fixed categories"
    assert 0 < value(samples, "shopper_prompts_emitted_total") == acct.prompts <= len(expected)
    assert value(samples, "shopper_results_written_total") == acct.insights + acct.errors
    assert value(samples, "shopper_superseded_written_total") == acct.superseded
    assert acct.prompts == acct.insights + acct.errors + acct.superseded
    assert value(samples, "shopper_llm_latency_seconds_count") == acct.insights
    assert value(samples, "shopper_llm_ttft_seconds_count") == acct.insights
    assert value(samples, "shopper_llm_latency_seconds_sum") > 0
    assert value(samples, "shopper_events_unaccounted") == 0
    assert value(samples, "shopper_prompts_unaccounted") == 0
    assert value(samples, "shopper_prompts_in_flight") == 0
    assert value(samples, "shopper_dead_letters_undelivered_total") == 0
    assert value(samples, "shopper_dead_letters_delivered_total") == malformed
    assert value(samples, "shopper_partitions_assigned") == 4
    enrichment = runner.enrichment
    assert enrichment is not None
    for cause, count in enrichment.counts.as_dict().items():
        assert value(samples, "shopper_prompts_not_sent_total", cause=cause) == count, cause
    assert value(samples, "shopper_admission_waiting") == value(samples, "shopper_admission_active") == 0
    ledger = enrichment.ledger
    assert ledger is not None, "the answer ledger is on by default"
    assert value(samples, "shopper_answer_ledger_total", op="recorded") == ledger.counts.recorded > 0
    for op in ("found", "other_events", "read_failures", "write_failures"):
        assert value(samples, "shopper_answer_ledger_total", op=op) == getattr(ledger.counts, op), op
    assert value(samples, "shopper_admission_limit") == enrichment.gate.limit > 0
    stats = runner.stats
    landed_prefill = value(samples, "shopper_llm_tokens_total", answer="landed", phase="prefill")
    assert landed_prefill == stats.prompt_tokens - stats.cached_tokens > 0  # the insights' uncached tokens
    assert value(samples, "shopper_llm_tokens_total", answer="landed", phase="decode") > 0
    not_landed = value(samples, "shopper_llm_tokens_total", answer="not_landed", phase="prefill")
    assert not_landed == enrichment.tokens.not_landed_prefill
    assert value(samples, "shopper_llm_tokens_not_landed_ratio") == enrichment.tokens.not_landed_share
    lags = {
        dict(labels)["partition"]: v
        for (name, labels), v in samples.items()
        if name == "shopper_consumer_lag"
    }
    assert lags == {"0": 0, "1": 0, "2": 0, "3": 0}, "caught up on every partition"
    assert 0 <= value(samples, "shopper_last_commit_age_seconds") < 60
    assert value(samples, "shopper_commits_total") == runner.stats.commits or runner.stats.commits > 0
    assert value(samples, "shopper_llm_cache_hit_ratio") > 0
    endpoints = {
        dict(labels)["endpoint"] for name, labels in samples if name == "shopper_llm_endpoint_healthy"
    }
    assert len(endpoints) == len(isolated.stack.stream_endpoints)
    assert value(samples, "shopper_runner_ready") == 1

    for probe in ("ready", "live", "health"):
        status, body = scraped[probe]
        report = json.loads(body)
        assert status == 200 and report["ready"] and report["live"], (probe, body)
        assert report["partitions"] == [0, 1, 2, 3] and report["failure"] is None
    assert scraped["missing"][0] == 404

    # RUNNER_LOG_FORMAT=json: every line the runner wrote is one JSON object with the fields.
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    logged = [json.loads(line) for line in lines]
    assert any(entry["msg"].startswith("[progress]") for entry in logged)
    done = [entry["msg"] for entry in logged if entry["msg"].startswith("[done]")]
    counts = f" insights {acct.insights} errors {acct.errors} superseded {acct.superseded} "
    assert done and counts in done[-1]
    assert any(entry["msg"].startswith("rebalance: assigned") for entry in logged)
    assert all({"ts", "level", "logger", "msg"} <= set(entry) for entry in logged)


def browse_bursts(shoppers: int, views: int) -> list[tuple[bytes, bytes, bool]]:
    """Each shopper browses ``views`` products 50 ms apart (no pause long enough to prompt), more than
    the session's default token budget holds, then adds one to the cart; stamped with the wall clock."""
    start = time.time() - (views + 1) * 0.05  # the last event is stamped now
    records = []
    for s in range(shoppers):
        shopper = f"burst-{s}"
        for n in range(views + 1):
            event = ShopperEvent(
                event_id=f"{shopper}-{n}",
                shopper_id=shopper,
                type="view" if n < views else "add_to_cart",
                ts=start + n * 0.05,
                product=ProductSnapshot(
                    product_id=f"p{n}",
                    title=f"Glow-in-the-dark skeleton costume, size {n % 7}",
                    category="Costumes",
                    price=19.5 + n % 5,
                    snippet="Kids loved it at the school parade",
                ),
            )
            records.append((shopper.encode(), event.model_dump_json().encode(), False))
    return records


@pytest.mark.slow
def test_events_trimmed_before_any_prompt_took_them_are_counted_and_named_by_the_results(
    isolated: Isolated,
) -> None:
    """A browse burst over the session's default budget: the log trims events no prompt has taken. The
    cart add's prompt names them (``trimmed_events``), the stored results carry them, and
    ``/metrics`` counts exactly those, as the same processor run offline predicts."""
    records = browse_bursts(shoppers=3, views=160)
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    expected = expected_prompts(records)
    expected_trimmed = sum(prompt.trimmed_events for prompt in expected.values())
    assert expected_trimmed > 0, "the bursts overflow the default budget"
    runner = EmbeddedRunner(isolated.runner(until_drained=False, metrics_port=0), log=lambda _: None)
    acct = runner.stats.accounting
    scraped: list[str] = []

    def stored() -> bool:
        return (
            acct.prompts == len(expected)
            and runner.in_flight == 0
            and runner.stats.last_commit_at is not None
            and not runner.epochs
        )

    async def check(address: str) -> None:
        async with aiohttp.ClientSession() as session:
            status, text = await get(session, f"{address}/metrics")
            assert status == 200
            scraped.append(text)

    asyncio.run(while_running(runner, stored, check))
    samples, _ = parse(scraped[0])
    assert value(samples, "shopper_events_trimmed_unprompted_total") == expected_trimmed
    _, results = list_s3_records(isolated.sinks(), isolated.s3_prefix)
    assert sum(int(r["trimmed_events"]) for r in results) == expected_trimmed
    named = sorted(i for r in results for i in [*r["new_event_ids"], *r["trimmed_event_ids"]])
    assert named == sorted(orjson.loads(v)["event_id"] for _, v, _ in records), "every event named once"


@pytest.mark.slow
def test_the_grafana_dashboard_asks_only_for_metrics_the_runner_exports(isolated: Isolated) -> None:
    """Scrape a running runner (after some traffic, so histograms and labelled series exist) and
    compare the names in every dashboard query with the names it exported."""
    records = SyntheticStream(shoppers=10, seed=92, malformed_rate=0.05).take(200)
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    runner = EmbeddedRunner(isolated.runner(until_drained=False, metrics_port=0), log=lambda _: None)
    acct = runner.stats.accounting
    exported: set[str] = set()

    async def check(address: str) -> None:
        async with aiohttp.ClientSession() as session:
            status, text = await get(session, f"{address}/metrics")
            assert status == 200
            exported.update(parse(text)[1])

    def busy() -> bool:  # traffic seen, and the lag measured (a task does, off the loop, once a second)
        return acct.consumed == len(records) and acct.insights > 0 and bool(runner.lag_by_partition())

    asyncio.run(while_running(runner, busy, check))
    used = dashboard_metric_names(DASHBOARD, METRIC_NAME)
    assert used - exported == set(), (
        f"the dashboard asks for metrics the runner does not export: {used - exported}"
    )
    assert len(used) >= 15, "the dashboard covers the runner's metrics"


def test_the_dashboard_is_provisioned_in_the_compose_stack() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    dashboards = ROOT / mounts["/var/lib/grafana/dashboards"]
    assert (dashboards / DASHBOARD.name).is_file()
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards/dashboards.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {datasource["uid"]}
    # Prometheus scrapes the runner service on the port the runner is told to serve.
    config_mount = next(v for v in prometheus["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    scrape = yaml.safe_load((ROOT / config_mount.split(":")[0]).read_text())["scrape_configs"]
    runner_env = services["runner"]["environment"]
    assert scrape[0]["static_configs"][0]["targets"] == [f"runner:{runner_env['RUNNER_METRICS_PORT']}"]
    assert runner_env["RUNNER_METRICS_HOST"] == "0.0.0.0"
    # The Flink job's enrichment runner exports the same names under another scrape job.
    assert unscoped_queries(DASHBOARD, METRIC_NAME, scrape[0]["job_name"]) == []


def test_reasons_fall_into_the_fixed_categories() -> None:
    from prompt_assembly.events import MalformedEvent, parse_event

    raw = [None, b"x" * 20_000, b"{not json", b'{"shopper_id": 5}', b"[]", b'{"event_type": "teleport"}']
    categories = []
    for value in raw:
        with pytest.raises(MalformedEvent) as rejected:
            parse_event(value)
        categories.append(reason_category(rejected.value.reason))
    assert categories == ["empty", "too_large", "invalid_json", "schema", "schema", "schema"]


def test_json_log_lines_carry_a_level() -> None:
    out = io.StringIO()
    log = line_logger("json", out)
    log("[progress] events 10")
    log("runner failing, nothing more will be committed: RuntimeError()")
    log("redis signal write failed, retrying: ConnectionError()")
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["level"] for e in entries] == ["info", "error", "warning"]
    assert entries[0]["logger"] == "runner" and entries[0]["ts"].endswith("+00:00")


class SlowStream(io.StringIO):
    """A stream that lets another thread run inside every write, as a pipe to a log collector may."""

    def write(self, text: str) -> int:
        time.sleep(0.0002)
        return super().write(text)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_lines_logged_from_several_threads_stay_whole_lines(fmt: LogFormat) -> None:
    """The rebalance callback logs from the consumer's poll thread while the loop logs progress: each
    line must reach the stream whole (``print`` wrote text and newline apart, and two JSON records
    once shared a line in CI)."""
    out = SlowStream()
    log = line_logger(fmt, out)

    def burst(thread: int) -> None:
        for i in range(100):
            log(f"[progress] thread {thread} line {i}")

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    texts = [json.loads(line)["msg"] for line in lines] if fmt == "json" else lines
    assert sorted(texts) == sorted(f"[progress] thread {t} line {i}" for t in range(4) for i in range(100))


@pytest.mark.slow
def test_an_idle_partition_the_group_finished_shows_no_lag(isolated: Isolated) -> None:
    """A runner drains the topic and commits; a second member of the same group, with nothing new to
    read, has no position on its partitions yet. Its lag ran from offset 0, so it reported the whole
    topic as behind (and the "falling behind" alert fired) until new records came; it runs from the
    group's committed offset now."""
    start = time.time()
    produce_records(
        isolated.stack.kafka_bootstrap, isolated.topic, [cart_add(f"s{i}", start + i) for i in range(40)]
    )
    first = asyncio.run(EmbeddedRunner(isolated.runner(), log=lambda _: None).run())
    assert first.accounting.consumed == 40 and first.commits > 0
    second = EmbeddedRunner(isolated.runner(until_drained=False, progress_interval_s=0.5), log=lambda _: None)

    async def scenario() -> dict[int, int]:
        async with running(second) as (task,):
            async with asyncio.timeout(60):
                while len(second.lag_by_partition()) < 4:
                    assert not task.done(), "the runner ended early"
                    await asyncio.sleep(0.1)
            return second.lag_by_partition()

    assert asyncio.run(scenario()) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert second.stats.accounting.consumed == 0
    # Up to date with nothing to commit: its durable points count as commits for the age, which grew
    # from its start on a healthy idle member (and set off the "nothing made durable" alert).
    assert second.stats.commits == 0 and second.stats.last_commit_at is not None


class CountingCommitted:
    """A real consumer whose ``committed`` calls (broker round trips) are counted."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer, self.calls = consumer, 0

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.calls += 1
        return self.consumer.committed(partitions, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


@pytest.mark.slow
def test_unread_partitions_lag_asks_the_committed_offsets_once_per_assignment(isolated: Isolated) -> None:
    """An idle member's lag runs from the group's committed offsets (see above): asked once, not at
    every measurement (each second), while it keeps the partitions (``EmbeddedRunner._measure_lag``
    keeps them per assignment)."""
    produce_records(
        isolated.stack.kafka_bootstrap, isolated.topic, [cart_add(f"s{i}", time.time()) for i in range(20)]
    )
    first = asyncio.run(EmbeddedRunner(isolated.runner(), log=lambda _: None).run())
    assert first.commits > 0
    consumer = Consumer({"bootstrap.servers": isolated.stack.kafka_bootstrap, "group.id": isolated.group})
    try:
        partitions = [TopicPartition(isolated.topic, p) for p in range(4)]
        consumer.assign(partitions)  # from the committed offsets, the ends: nothing to read, no positions
        deadline = time.monotonic() + 30
        while any(consumer.get_watermark_offsets(tp, cached=True)[1] < 0 for tp in partitions):
            assert consumer.poll(0.2) is None and time.monotonic() < deadline  # fetches teach the watermarks
        counting, committed = CountingCommitted(consumer), dict[int, int]()
        measured = [cached_lag_by_partition(counting, partitions, committed) for _ in range(3)]  # type: ignore[arg-type]
        fresh = cached_lag_by_partition(CountingCommitted(consumer), partitions)  # type: ignore[arg-type]
    finally:
        consumer.close()
    assert measured == [fresh] * 3 and fresh == {0: 0, 1: 0, 2: 0, 3: 0}
    assert counting.calls == 1 and set(committed) == {0, 1, 2, 3}


def test_a_member_without_partitions_is_live_but_not_ready(isolated: Isolated) -> None:
    """Two runners in one group on a one-partition topic: the member left without a partition answers
    /health/live 200 and /health/ready 503 with the reason, and exports shopper_runner_ready 0."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic = f"{isolated.topic}-single"
    admin = AdminClient({"bootstrap.servers": isolated.stack.kafka_bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(timeout=10)
    logs: list[list[str]] = [[], []]
    runners = [
        EmbeddedRunner(isolated.runner(topic=topic, until_drained=False, metrics_port=0), log=logs[i].append)
        for i in range(2)
    ]
    answers: dict[str, tuple[int, str]] = {}

    def settled() -> bool:
        latest = [
            next((line for line in reversed(log) if "rebalance: assigned" in line), None) for log in logs
        ]
        return all(line is not None for line in latest) and sorted(
            len(r.assigned_partitions()) for r in runners
        ) == [0, 1]

    async def scenario() -> None:
        tasks = [asyncio.create_task(r.run()) for r in runners]
        try:
            async with asyncio.timeout(90):
                while not settled() or any(r.ops is None for r in runners):
                    assert not any(t.done() for t in tasks), "a runner ended early"
                    await asyncio.sleep(0.05)
            idle = next(r for r in runners if not r.assigned_partitions())
            busy = next(r for r in runners if r.assigned_partitions())
            assert idle.ops is not None and busy.ops is not None
            async with aiohttp.ClientSession() as session:
                answers["idle_ready"] = await get(session, f"{idle.ops.address}/health/ready")
                answers["idle_live"] = await get(session, f"{idle.ops.address}/health/live")
                answers["idle_metrics"] = await get(session, f"{idle.ops.address}/metrics")
                answers["busy_ready"] = await get(session, f"{busy.ops.address}/health/ready")
        finally:
            for runner in runners:
                runner.request_stop()
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    status, body = answers["idle_ready"]
    assert status == 503 and json.loads(body)["why_not_ready"] == "no partitions assigned"
    assert answers["idle_live"][0] == 200
    samples, _ = parse(answers["idle_metrics"][1])
    assert value(samples, "shopper_runner_ready") == 0 and value(samples, "shopper_partitions_assigned") == 0
    assert answers["busy_ready"][0] == 200


def older_session_insight(shopper_id: str) -> ShopperInsight:
    """An answer a previous session of ``shopper_id`` left in Redis (epoch 1: long before any event of
    the stream), as if that session's state had since been lost or expired."""
    summary = "an answer of a session whose state is gone"
    return ShopperInsight(
        request_id=f"{shopper_id}:1:7",
        shopper_id=shopper_id,
        session_epoch=1,
        seq=7,
        reason="add_to_cart",
        understanding=ShopperUnderstanding(
            interests=["hats"], occasion=None, style="fun", price_sensitivity="low", summary=summary
        ),
        text=summary,
        model="m",
        replica="r0",
        usage=Usage(),
        event_count=7,
        last_event_ts=1.0,
        ttft_ms=1,
        latency_ms=1,
        attempts=1,
        produced_at=time.time(),
    )


@pytest.mark.slow
def test_a_session_that_replaces_a_lost_ones_signal_is_counted_as_a_reset(isolated: Isolated) -> None:
    """Shoppers whose signal outlived their session state: the runner's first answer for each replaces
    the old session's signal (a newer session epoch), and ``shopper_session_resets_total`` says how
    many times, as the shoppers' hashes count it."""
    records = SyntheticStream(shoppers=6, seed=93).take(240)
    lost = sorted({key.decode() for key, _, _ in records})[:3]
    sink = RedisSignalSink(isolated.sinks())

    async def seed() -> None:
        await sink.open()
        await sink.write([older_session_insight(shopper) for shopper in lost])
        await sink.close()

    asyncio.run(seed())
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    runner = EmbeddedRunner(isolated.runner(until_drained=False, metrics_port=0), log=lambda _: None)
    acct = runner.stats.accounting
    scraped: dict[str, str] = {}

    async def check(address: str) -> None:
        async with aiohttp.ClientSession() as session:
            status, scraped["metrics"] = await get(session, f"{address}/metrics")
            assert status == 200

    def stored() -> bool:
        return acct.consumed == len(records) and acct.insights > 0 and runner.in_flight == 0

    asyncio.run(while_running(runner, stored, check))

    async def resets_in_hashes() -> int:
        reader = RedisSignalSink(isolated.sinks())
        hashes = [await reader.read(shopper) for shopper in lost]
        await reader.close()
        return sum(int(stored_hash.get("resets", 0)) for stored_hash in hashes)

    counted = asyncio.run(resets_in_hashes())
    samples, _ = parse(scraped["metrics"])
    assert counted > 0, "a shopper of the stream got an answer over its lost session's signal"
    assert value(samples, "shopper_session_resets_total") == counted


def test_an_until_drained_run_says_in_its_progress_line_what_it_waits_for(isolated: Isolated) -> None:
    """A run that has stopped reading but not ended names what it waits for, so a run that never ends
    (a test past its timeout, a backfill that hangs) says why in its last lines."""
    records = SyntheticStream(shoppers=5, seed=17, malformed_rate=0.0).take(40)
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)
    logged: list[str] = []
    runner = EmbeddedRunner(isolated.runner(progress_interval_s=0.2, drain_idle_s=2.0), log=logged.append)
    stats = asyncio.run(runner.run())
    assert stats.accounting.consumed == len(records)
    waits = [line for line in logged if line.startswith("[progress]") and "(not drained: " in line]
    assert any("(not drained: quiet for less than drain_idle_s (2 s))" in line for line in waits), logged
    assert not [line for line in logged if line.startswith("[done]") and "not drained" in line]
