"""The Flink job's pure parts, without a MiniCluster: DLQ records, the sink group commit, retry
predicate, settings round trip, and the fail-fast message when the connector jar is missing."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

# PyFlink is the 'flink' extra, which `make test` installs: a missing PyFlink fails here, never skips.
import pyflink  # noqa: F401
import pytest

from flink_jobs import flink_connectors
from flink_jobs.flink_config import NearRealtimeSettings
from flink_jobs.flink_functions import _token_gauge, gate, is_retryable_result, parse_result
from flink_jobs.flink_metrics import OperatorStats
from pipeline.checkpoint import Checkpoint
from pipeline.overload import TokenCounts
from pipeline.sink_commit import SinkCommitter
from pipeline.sink_retry import SinkRetry
from prompt_assembly.records import EnrichmentError, EnrichmentResult, Superseded
from sinks.config import SinkSettings

ROOT = Path(__file__).resolve().parents[2]


def _error(n: int, error_type: str = "InvalidAnswer") -> EnrichmentError:
    return EnrichmentError(
        request_id=f"s:{n}",
        shopper_id="s",
        seq=n,
        reason="browse_pause",
        error_type=error_type,
        message="m",
        attempts=1,
        last_event_ts=1.0,
        produced_at=2.0,
    )


def test_dead_letters_keep_text_as_utf8_binary_as_base64_and_honour_the_size_limit() -> None:
    text = orjson.loads(str(gate((b'{"a":', "t", 3, 9, None))))
    assert (text["original"], text["original_encoding"], text["partition"], text["offset"]) == (
        '{"a":',
        "utf-8",
        3,
        9,
    )
    binary = orjson.loads(str(gate((b"\xff\x00", None, None, None, None))))
    assert binary["original_encoding"] == "base64"
    assert base64.b64decode(binary["original"]) == b"\xff\x00"
    assert orjson.loads(str(gate((None, None, None, None, None))))["original"] is None
    cut = orjson.loads(str(gate((b"{" + b"x" * 500, "t", 0, 1, None), max_original_bytes=100)))
    assert len(cut["original"]) == 100 and cut["truncated"] is True


def test_only_no_healthy_endpoint_errors_are_retried_by_flink() -> None:
    assert is_retryable_result([_error(1, "NoHealthyEndpoint").model_dump_json()])
    assert not is_retryable_result([_error(1, "RetryBudgetExhausted").model_dump_json()])
    assert isinstance(parse_result(_error(1).model_dump_json()), EnrichmentError)


def test_a_superseded_result_is_read_as_one_never_as_an_insight() -> None:
    """The overload step's third kind: the sink step read every non-error result as an insight, and a
    superseded prompt's result failed the job with a ShopperInsight validation error."""
    superseded = Superseded(
        request_id="s:1",
        shopper_id="s",
        seq=1,
        reason="browse_pause",
        cause="newer_prompt",
        superseded_by="s:2",
        last_event_ts=1.0,
        produced_at=2.0,
    )
    assert parse_result(superseded.model_dump_json()) == superseded
    assert not is_retryable_result([superseded.model_dump_json()])


def test_settings_round_trip_through_json_keeps_secrets_usable() -> None:
    settings = NearRealtimeSettings(sinks=SinkSettings(s3_access_key_id="k", s3_secret_access_key="s"))
    again = NearRealtimeSettings.from_json(settings.to_json())
    assert again.sinks.s3_secret_access_key is not None
    assert again.sinks.s3_secret_access_key.get_secret_value() == "s"
    assert again.model_dump(exclude={"sinks"}) == settings.model_dump(exclude={"sinks"})


def test_two_jobs_on_one_cluster_never_share_transactional_ids() -> None:
    """The exactly-once sinks' transactional-id prefix was one constant for every job: a second job on
    the same cluster and topic fenced the first one's producers, and that job's committed checkpoint
    lost its insights. By default it is the job's group id now; a prefix set explicitly still wins."""
    blue = NearRealtimeSettings.model_validate({"kafka": {"group_id": "su-blue"}})
    green = NearRealtimeSettings.model_validate({"kafka": {"group_id": "su-green"}})

    def prefix(settings: NearRealtimeSettings) -> str:
        ddl = flink_connectors.keyed_sink_ddl(settings, "insights", "shopper-insights", exactly_once=True)
        return next(line for line in ddl.splitlines() if "transactional-id-prefix" in line)

    assert prefix(blue) != prefix(green)
    assert "'su-blue-shopper-insights'" in prefix(blue)
    named = NearRealtimeSettings.model_validate(
        {"kafka": {"group_id": "su-blue", "transactional_id_prefix": "tx"}}
    )
    assert "'tx-shopper-insights'" in prefix(named)


def test_settings_load_from_the_compose_job_file() -> None:
    settings = NearRealtimeSettings.load(ROOT / "docker/flink-job.yaml")
    assert settings.async_io.bundle_time_ms == 250 and settings.parallelism == 2


class FakeSink:
    """Records what the group committer asks of a sink (the real sinks have their own tests)."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name = name
        self.written: list[str] = []
        self.flushed: list[list[str]] = []
        self.buffer: list[str] = []
        self.fail = fail
        self.closed = False

    async def open(self) -> None:
        return None

    async def write(self, results: Sequence[EnrichmentResult]) -> None:
        if self.fail:
            raise ConnectionError("store down")
        self.buffer += [r.request_id for r in results]
        self.written += [r.request_id for r in results]

    def due(self) -> bool:
        return False

    async def flush(self) -> None:
        self.flushed.append(self.buffer)
        self.buffer = []

    async def close(self) -> None:
        self.closed = True


async def test_a_result_completes_only_after_its_s3_flush() -> None:
    redis, s3 = FakeSink("redis"), FakeSink("s3")
    committer = SinkCommitter(Checkpoint([redis, s3], SinkRetry()), idle_flush_s=0.05)
    started = time.monotonic()
    await asyncio.gather(*(committer.submit(_error(n)) for n in range(20)))
    assert time.monotonic() - started >= 0.04  # waited for the idle flush
    assert sorted(redis.written) == sorted(f"s:{n}" for n in range(20))
    assert sorted(rid for batch in s3.flushed for rid in batch) == sorted(redis.written)
    assert committer.flushes == 1 and committer.batches >= 1
    await committer.close()
    assert s3.closed and redis.closed


async def test_a_failed_write_fails_every_waiting_call() -> None:
    retry = SinkRetry(max_wait_s=0.05, initial_backoff_s=0.01)
    committer = SinkCommitter(
        Checkpoint([FakeSink("redis", fail=True), FakeSink("s3")], retry), idle_flush_s=0.01
    )
    results = await asyncio.gather(*(committer.submit(_error(n)) for n in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    with pytest.raises(ConnectionError):  # a stopped committer keeps refusing
        await committer.submit(_error(9))


def test_operator_stats_publish_gauges() -> None:
    class Group:
        def __init__(self) -> None:
            self.gauges: dict[str, object] = {}

        def gauge(self, name: str, fn: object) -> None:
            self.gauges[name] = fn

    stats, group = OperatorStats(), Group()
    stats.register(group, counters=["a"], windows=["lat"], extra={"ratio": lambda: stats.permille("a", "b")})
    stats.inc("a", 3)
    stats.inc("b", 4)
    for value in (10, 20, 30, 40):
        stats.observe("lat", value)
    values = {name: fn() for name, fn in group.gauges.items()}  # type: ignore[operator]
    assert values == {"a": 3, "lat_p50_ms": 30, "lat_p99_ms": 40, "ratio": 750}


def test_missing_connector_jar_fails_fast_naming_both_ways_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(flink_connectors, "LIB_DIR", tmp_path / "lib")
    monkeypatch.setenv("SHOPPER_FLINK_JARS_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLINK_HOME", raising=False)
    monkeypatch.delenv("FLINK_CONNECTOR_JARS", raising=False)
    with pytest.raises(flink_connectors.MissingConnectorJar, match="scripts/fetch-flink-connectors") as err:
        flink_connectors.kafka_connector_jars()
    assert "devstack.flink_jars" in str(err.value)


def test_one_consistent_jar_set_is_chosen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The PyPI thin jars from the cache, unless the Maven SQL jar is in flink_jobs/lib (never both:
    the same classes from two jars); an explicit FLINK_CONNECTOR_JARS wins over both."""
    lib, cache = tmp_path / "lib", tmp_path / "cache"
    lib.mkdir()
    cache.mkdir()
    monkeypatch.setattr(flink_connectors, "LIB_DIR", lib)
    monkeypatch.setenv("SHOPPER_FLINK_JARS_DIR", str(cache))
    monkeypatch.delenv("FLINK_HOME", raising=False)
    monkeypatch.delenv("FLINK_CONNECTOR_JARS", raising=False)
    thin = [cache / name for name in flink_connectors.PYPI_JARS]
    thin[0].write_bytes(b"PK")
    with pytest.raises(flink_connectors.MissingConnectorJar):  # half a set is no set
        flink_connectors.kafka_connector_jars()
    thin[1].write_bytes(b"PK")
    assert flink_connectors.kafka_connector_jars() == [j.as_uri() for j in thin]
    sql = lib / "flink-sql-connector-kafka-5.0.0-2.2.jar"
    sql.write_bytes(b"PK")
    assert flink_connectors.kafka_connector_jars() == [sql.as_uri()]
    monkeypatch.setenv("FLINK_CONNECTOR_JARS", str(thin[1]))
    assert flink_connectors.kafka_connector_jars() == [thin[1].as_uri()]


def test_the_offset_reset_enum_is_the_one_the_loaded_connector_declares() -> None:
    """PyFlink's wrapper always asks for the SQL jar's shaded enum; the job reads the parameter type
    of ``OffsetsInitializer.committedOffsets`` instead, so the thin jar works too."""
    shaded = "org.apache.flink.kafka.shaded.org.apache.kafka.clients.consumer.OffsetResetStrategy"
    plain = "org.apache.kafka.clients.consumer.OffsetResetStrategy"
    thin_jar = [[], [(plain, True)], [("java.util.Map", False)]]
    sql_jar = [[], [(shaded, True)], [("java.util.Map", False)]]
    assert flink_connectors.reset_strategy_class(thin_jar) == plain
    assert flink_connectors.reset_strategy_class(sql_jar) == shaded
    with pytest.raises(flink_connectors.MissingConnectorJar):
        flink_connectors.reset_strategy_class([[("java.util.Map", False)], [(plain, False)]])


def test_cli_without_the_jar_exits_2_with_the_message(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flink_jobs.near_realtime"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        # an explicit jar list that names no file: no other place is searched
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(Path.home()),
            "FLINK_CONNECTOR_JARS": str(tmp_path / "x.jar"),
        },
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "scripts/fetch-flink-connectors" in proc.stderr


def test_the_gate_writes_the_shared_dead_letter_and_bounded_keys_never_fail() -> None:
    from flink_jobs.flink_functions import gate, shopper_key, source_record
    from pipeline.dead_letter import dead_letter

    row = (b"\xff\xfe", "events", 3, 41, 1_700_000_000_123)
    letter = gate(source_record(row, None, False))
    assert isinstance(letter, str)
    expected = dead_letter(
        b"\xff\xfe", orjson.loads(letter)["reason"], topic="events", partition=3, offset=41
    )
    assert letter.encode() == expected.model_copy(update={"timestamp_ms": 1_700_000_000_123}).to_bytes()
    tombstone = orjson.loads(str(gate(source_record((None, "events", 0, 7, 5), None, False))))
    assert (tombstone["original"], tombstone["offset"], tombstone["reason"]) == (
        None,
        7,
        "empty message (null value)",
    )
    encoded = base64.b64encode(b'{"shopper_id": "s-1", "type": "view"}').decode()
    assert shopper_key(encoded) == "s-1"
    # Records without a shopper id spread over the subtasks: a key of their own, never one hot key.
    unkeyed = [b"\xff not json", b'{"shopper_id": 7}', b'{"shopper_id": ""}', b'{"type": "view"}']
    keys = [shopper_key(base64.b64encode(value).decode()) for value in unkeyed]
    assert all(key.startswith(flink_connectors.UNKEYED_PREFIX) for key in keys)
    assert len(set(keys)) == len(unkeyed)


def test_the_latency_settings_reach_the_source_and_the_flink_configuration() -> None:
    from flink_jobs.flink_config import KafkaSettings
    from flink_jobs.near_realtime import job_configuration

    settings = NearRealtimeSettings(
        kafka=KafkaSettings(fetch_max_wait_ms=40), buffer_timeout_ms=7, session_stage_mode="thread"
    )
    assert "'properties.fetch.max.wait.ms' = '40'" in flink_connectors.kafka_source_ddl(settings)
    overridden = settings.model_copy(deep=True)
    overridden.kafka.consumer_properties = {"fetch.max.wait.ms": "500"}
    ddl = flink_connectors.kafka_source_ddl(overridden)
    assert "'properties.fetch.max.wait.ms' = '500'" in ddl and "= '40'" not in ddl
    conf = job_configuration(settings, local=True).to_dict()
    assert conf["execution.buffer-timeout.interval"] == "7 ms"
    assert conf["python.execution-mode"] == "thread"
    assert str(ROOT) in conf["python.pythonpath"].split(":")
    process = NearRealtimeSettings(session_stage_mode="process")
    assert "python.execution-mode" not in job_configuration(process, local=True).to_dict()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_only_the_session_stage_follows_the_session_stage_mode(mode: str) -> None:
    """PyFlink has no async function in thread mode: the async stage is a worker process either way."""
    from pyflink.common import Types

    from flink_jobs.flink_functions import shopper_key
    from flink_jobs.near_realtime import build_pipeline, create_environment

    settings = NearRealtimeSettings(session_stage_mode=mode, prompts_topic=None)  # the async stage
    env = create_environment(settings, local=True)
    raw = env.from_collection(["e30="], type_info=Types.STRING())
    pipeline = build_pipeline(
        raw.key_by(shopper_key, key_type=Types.STRING()), settings, source_topic=None, base64_values=True
    )
    pipeline.results.print()
    graph = env._j_stream_execution_environment.getStreamGraph(False)
    operators = {
        str(node.getOperatorName()): str(node.getOperatorFactory().getOperator().getClass().getSimpleName())
        for node in graph.getStreamNodes().toArray()
        if hasattr(node.getOperatorFactory(), "getOperator")
    }
    embedded = (
        "EmbeddedPythonKeyedProcessOperator" if mode == "thread" else "ExternalPythonKeyedProcessOperator"
    )
    assert operators["gate and shopper sessions"] == embedded
    assert operators["enrich prompts (LLM), write redis, s3"] == "ExternalPythonProcessOperator"


def test_token_gauges_read_the_enrichers_counts_and_are_zero_before_it_starts() -> None:
    class Enricher:
        def __init__(self) -> None:
            self.tokens = TokenCounts()

    class Operator:
        enricher: Enricher | None = None

    operator = Operator()
    gauge = _token_gauge(operator, "not_landed_prefill")
    assert gauge() == 0
    operator.enricher = Enricher()
    operator.enricher.tokens.landed(1000, 400, 91, ttft_s=0.5, latency_s=5.0)  # 50 ms a token
    operator.enricher.tokens.not_landed(700, in_flight_s=3.0, max_tokens=200)
    assert gauge() == 700
    assert _token_gauge(operator, "landed_prefill")() == 600
    assert _token_gauge(operator, "not_landed_decode")() == 50  # (3.0 - 0.5) s at 50 ms a token


def test_both_engines_refuse_a_non_finite_literal_with_one_reason() -> None:
    """Python's ``json.dumps`` writes ``NaN`` for a float nan. Pydantic's parser took it in a field the
    schema ignores, so the runner accepted the event; the Flink job read its key with ``JSON_VALUE``,
    which refuses it, and dead-lettered it as a misplaced event. Now both gates refuse it as invalid
    JSON, with the same reason."""
    from flink_jobs.flink_functions import gate, source_record
    from prompt_assembly.events import MalformedEvent, parse_events

    event = {
        "event_id": "e-nan",
        "shopper_id": "s-1",
        "type": "view",
        "ts": 1_761_800_000.5,
        "product": {"product_id": "p-1", "title": "Witch Costume", "price": 19.99},
        "dwell_ms": float("nan"),
    }
    raw = json.dumps(event).encode()
    assert b"NaN" in raw
    letter = gate(source_record((raw, "events", 0, 1, 1_761_800_000_600), None, False))
    assert isinstance(letter, str)
    (refused,) = parse_events([raw], [1_761_800_000.6])
    assert isinstance(refused, MalformedEvent)
    assert (
        orjson.loads(letter)["reason"]
        == refused.reason
        == "invalid JSON: NaN is not a JSON number (RFC 8259)"
    )


class _ValueState:
    def __init__(self) -> None:
        self.raw: str | None = None

    def value(self) -> str | None:
        return self.raw

    def update(self, raw: str) -> None:
        self.raw = raw

    def clear(self) -> None:
        self.raw = None


class _Counter:
    def inc(self, n: int = 1) -> None:
        pass


class _MetricGroup:
    def add_group(self, name: str) -> _MetricGroup:
        return self

    def counter(self, name: str) -> _Counter:
        return _Counter()


class _RuntimeContext:
    def __init__(self) -> None:
        self.states: dict[str, _ValueState] = {}

    def get_state(self, descriptor: object) -> _ValueState:
        return self.states.setdefault(descriptor.get_name(), _ValueState())  # type: ignore[attr-defined]

    def get_metrics_group(self) -> _MetricGroup:
        return _MetricGroup()


class _TimerService:
    def current_processing_time(self) -> int:
        return int(time.time() * 1000)

    def register_processing_time_timer(self, ts: int) -> None:
        pass

    def delete_processing_time_timer(self, ts: int) -> None:
        pass

    def register_event_time_timer(self, ts: int) -> None:
        pass

    def delete_event_time_timer(self, ts: int) -> None:
        pass


class _KeyedContext:
    def __init__(self, key: str) -> None:
        self.key = key

    def get_current_key(self) -> str:
        return self.key

    def timer_service(self) -> _TimerService:
        return _TimerService()


def test_an_event_whose_shopper_id_is_not_its_key_is_a_dead_letter() -> None:
    """The JVM keys a record by the shopper id JSON_VALUE read; where pydantic reads another one (a
    duplicated field), the event goes to the DLQ side output, never into the wrong shopper's session."""
    from flink_jobs.flink_functions import DLQ_TAG, ShopperSessionFunction

    event = {
        "event_id": "e1",
        "shopper_id": "s-1",
        "type": "view",
        "ts": time.time(),
        "product": {"product_id": "p1", "title": "Trail shoe", "price": 90.0},
    }
    value = orjson.dumps(event).decode()
    function = ShopperSessionFunction(NearRealtimeSettings().to_json(), True, False)
    runtime = _RuntimeContext()
    function.open(runtime)

    out = list(function.process_element(value, _KeyedContext("s-2")))
    assert len(out) == 1
    tag, (kafka_key, letter) = out[0]
    assert tag is DLQ_TAG and kafka_key is None  # a bounded run's value: no Kafka key
    reason = orjson.loads(letter)["reason"]
    assert "is not the key" in reason and "'s-1'" in reason and "'s-2'" in reason
    assert runtime.states["session"].value() is None  # no session for either shopper

    # The same event under its own key is accepted into the session (the check, not the fake, refused it).
    assert list(function.process_element(value, _KeyedContext("s-1"))) == []
    assert runtime.states["session"].value() is not None


def test_a_dead_letter_leaves_with_its_kafka_records_key_as_it_is() -> None:
    """A source row's Kafka key (any bytes, or none) goes with its dead letter to the keyed DLQ sink."""
    from flink_jobs.flink_functions import DLQ_TAG, ShopperSessionFunction

    function = ShopperSessionFunction(NearRealtimeSettings().to_json(), True, False, "events")
    function.open(_RuntimeContext())
    for key in (b"s-1", b"\xff\x00 not UTF-8", None):
        row = (b"{broken", "events", 2, 40, 1_700_000_000_000, key)
        ((tag, (kafka_key, letter)),) = function.process_element(row, _KeyedContext("(no shopper id) 2:40"))
        assert tag is DLQ_TAG and kafka_key == key
        assert orjson.loads(letter)["offset"] == 40
