"""Kafka source and sinks of the job, from the official Flink Kafka connector, and where its jars are.

The connector is released apart from Flink and is not part of the PyFlink wheel. Two ways to get it,
both pinned by SHA-256 (provenance in docs/dependencies.md):

- **Maven** (clusters, the compose image): ``scripts/fetch-flink-connectors`` puts the official
  *SQL* (uber) jar ``flink-sql-connector-kafka-*.jar`` into ``flink_jobs/lib/``; it shades kafka-clients.
- **PyPI** (where Maven Central is unreachable; what ``make test`` uses): ``python -m devstack.flink_jars``
  extracts the *thin* ``flink-connector-kafka.jar`` (4.0.1-2.0) and ``kafka-clients.jar`` (3.9.1) from
  the ``shigawire-apache-flink-libraries`` wheel into ``connector_cache_dir()``.

``kafka_connector_jars`` picks one set (never both: the same classes twice would be loaded from two
jars) and fails fast, before any Java class is touched, with a message naming both ways.

The two jars differ in one place that PyFlink's wrapper trips over: the SQL jar shades
``OffsetResetStrategy`` and PyFlink's ``KafkaOffsetResetStrategy`` looks up only the shaded name.
``committed_offsets_or`` builds the initializer from the parameter type that the loaded connector's
``OffsetsInitializer.committedOffsets`` actually declares (``reset_strategy_class``), so one code path
works with either jar. The SASL login module that the JAAS line names differs the same way, and JAAS
loads it by name: ``connector_kafka_properties`` names the class that the jars found actually hold.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.kafka_security import SHADED_PREFIX, KafkaSecurity, java_kafka_properties, login_module
from prompt_assembly.errors import ShopperError

LIB_DIR = Path(__file__).resolve().parent / "lib"
JAR_GLOB = "flink-sql-connector-kafka-*.jar"
FETCH_SCRIPT = "scripts/fetch-flink-connectors"
PROVISION_COMMAND = "python -m devstack.flink_jars"

CONNECTOR_WHEEL = "shigawire-apache-flink-libraries==2.0.0.post1"
CONNECTOR_WHEEL_SHA256 = "aaa65537d3f0c0ff279185d8243024f0efd95788ba044bf249ba0f40b69289cd"
PYPI_JARS: dict[str, str] = {
    # flink-connector-kafka 4.0.1-2.0 (thin: kafka-clients is not shaded in)
    "flink-connector-kafka.jar": "842885a51c768b2f31c946a2071656c166ee8cc6d3c02fe6c557e134e03bf228",
    # org.apache.kafka:kafka-clients 3.9.1
    "kafka-clients.jar": "7568b998572d256f0b7bc0afdc1b7a2588b8b08415c62ce314c864a6851ae9d9",
}
"""The only two jars taken from the wheel (it also carries Flink 2.0 and JDBC jars: never used)."""

OFFSETS_INITIALIZER = "org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer"
ResetStrategy = Literal["EARLIEST", "LATEST", "NONE"]


class MissingConnectorJar(ShopperError, RuntimeError):
    """The Kafka connector jar is on neither the job's lib folder, the cache nor the cluster's classpath."""


def connector_cache_dir() -> Path:
    """Where the PyPI-provisioned jars live: ``$SHOPPER_FLINK_JARS_DIR``, else the user cache."""
    explicit = os.environ.get("SHOPPER_FLINK_JARS_DIR")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "shopper-understanding" / "flink-jars"


def cached_pypi_jars(cache_dir: Path | None = None) -> list[Path]:
    """The two PyPI jars when both are in the cache (checksums are verified when they are extracted)."""
    folder = cache_dir or connector_cache_dir()
    jars = [folder / name for name in PYPI_JARS]
    return jars if all(j.is_file() for j in jars) else []


def find_kafka_connector_jars() -> list[Path]:
    """One consistent set of connector jars, first found wins: ``$FLINK_CONNECTOR_JARS`` (explicit,
    ``os.pathsep``-separated), the Maven SQL jar in ``flink_jobs/lib``, the PyPI thin jars in the cache,
    the SQL jar in ``$FLINK_HOME/lib``."""
    extra = os.environ.get("FLINK_CONNECTOR_JARS")
    if extra:
        return [p for p in (Path(s) for s in extra.split(os.pathsep) if s) if p.is_file()]
    sql_jars = sorted(LIB_DIR.glob(JAR_GLOB))
    if sql_jars:
        return sql_jars[-1:]
    thin = cached_pypi_jars()
    if thin:
        return thin
    flink_home = os.environ.get("FLINK_HOME")
    if flink_home:
        return sorted((Path(flink_home) / "lib").glob(JAR_GLOB))[-1:]
    return []


def kafka_connector_jars() -> list[str]:
    """``file://`` URLs to add to the job; raises ``MissingConnectorJar`` naming both ways to get them."""
    jars = find_kafka_connector_jars()
    if not jars:
        raise MissingConnectorJar(
            f"the Flink Kafka connector jars were not found in $FLINK_CONNECTOR_JARS, {LIB_DIR} "
            f"({JAR_GLOB}), {connector_cache_dir()} or $FLINK_HOME/lib. Run `{PROVISION_COMMAND}` "
            f"(the pinned jars from PyPI) or `{FETCH_SCRIPT}` (the pinned SQL jar from Maven), or use "
            "the compose Flink image, which has it baked in."
        )
    flink_home = os.environ.get("FLINK_HOME")
    if flink_home and all(str(j).startswith(str(Path(flink_home) / "lib")) for j in jars):
        return []  # already on the cluster classpath; shipping it again would load it twice
    return [j.resolve().as_uri() for j in jars]


def kafka_clients_shaded(jars: Iterable[Path]) -> bool:
    """Whether the Kafka client in ``jars`` is relocated under ``SHADED_PREFIX`` (the SQL uber jar)
    or plain ``org.apache.kafka`` (the thin connector with ``kafka-clients.jar``), read from the jars'
    own entries: a JAAS line must name the login module class that is really on the classpath."""
    plain = login_module("PLAIN", shaded=False).replace(".", "/") + ".class"
    for jar in jars:
        with zipfile.ZipFile(jar) as archive:
            names = set(archive.namelist())
        if SHADED_PREFIX.replace(".", "/") + plain in names:
            return True
        if plain in names:
            return False
    raise MissingConnectorJar(
        f"no Kafka client (org.apache.kafka.common.security) in {[str(j) for j in jars]}: the Kafka "
        f"connector jars are incomplete; run `{PROVISION_COMMAND}` or `{FETCH_SCRIPT}`"
    )


def connector_kafka_properties(security: KafkaSecurity) -> dict[str, str]:
    """``java_kafka_properties`` for the connector jars this job runs with (``find_kafka_connector_jars``):
    with SASL, the JAAS line names the login module shaded or not as those jars hold it."""
    if security.sasl_mechanism is None:  # no class is named
        return java_kafka_properties(security, shaded=False)
    return java_kafka_properties(security, shaded=kafka_clients_shaded(find_kafka_connector_jars()))


def reset_strategy_class(overloads: Iterable[Sequence[tuple[str, bool]]]) -> str:
    """The Java enum that ``OffsetsInitializer.committedOffsets`` takes, from its overloads' parameter
    types as ``(class name, is enum)``: the unshaded ``org.apache.kafka...OffsetResetStrategy`` of the
    thin jar + kafka-clients, or the shaded ``org.apache.flink.kafka.shaded...`` one of the SQL jar."""
    candidates = sorted(
        params[0][0]
        for params in overloads
        if len(params) == 1 and params[0][1] and params[0][0].endswith(".OffsetResetStrategy")
    )
    if not candidates:
        raise MissingConnectorJar(
            "the loaded Kafka connector has no committedOffsets(OffsetResetStrategy): "
            "not a flink-connector-kafka 3.x/4.x/5.x jar?"
        )
    return candidates[0]


def committed_offsets_or(reset: ResetStrategy = "EARLIEST") -> Any:
    """``KafkaOffsetsInitializer.committed_offsets(reset)`` that works with either connector jar:
    start from the group's committed offsets, and from ``reset`` where the group has none."""
    from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import load_java_class

    gateway = get_gateway()
    initializer = load_java_class(OFFSETS_INITIALIZER)
    overloads = [
        [(p.getName(), bool(p.isEnum())) for p in method.getParameterTypes()]
        for method in initializer.getMethods()
        if method.getName() == "committedOffsets"
    ]
    strategy = load_java_class(reset_strategy_class(overloads))
    j_reset = gateway.jvm.java.lang.Enum.valueOf(strategy, reset)
    j_initializer = gateway.jvm
    for part in OFFSETS_INITIALIZER.split("."):
        j_initializer = getattr(j_initializer, part)
    return KafkaOffsetsInitializer(j_initializer.committedOffsets(j_reset))


SOURCE_TABLE = "shopper_events_source"
SOURCE_COLUMNS = ("value", "topic", "partition", "offset", "timestamp_ms", "kafka_key")
"""What each source row holds: the raw value bytes (``None`` for a tombstone), where it came from, and
the record's Kafka key as it is (``None`` for none), which only its dead letter carries on: the DLQ is
keyed by the original's key, as the runner keys it (``sink_dead_letters``)."""


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def kafka_source_ddl(settings: NearRealtimeSettings, *, stop_at_latest: bool = False) -> str:
    """``CREATE TEMPORARY TABLE`` of the events topic: the ``raw`` format for the value and the key
    (bytes as they are, a tombstone or a record without a key is a NULL) and the record's topic,
    partition, offset and Kafka timestamp as metadata columns. Committed group offsets, earliest where
    the group has none; offsets are committed on checkpoints (the source's default when a group id is
    set)."""
    kafka = settings.kafka
    options: dict[str, str] = {
        "connector": "kafka",
        "topic": kafka.events_topic,
        "properties.bootstrap.servers": kafka.bootstrap_servers,
        "properties.group.id": kafka.group_id,
        "scan.startup.mode": "group-offsets",
        "properties.auto.offset.reset": "earliest",
        "scan.topic-partition-discovery.interval": "60 s",
        "properties.fetch.max.wait.ms": str(kafka.fetch_max_wait_ms),
        "key.format": "raw",
        "key.fields": "kafka_key",
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
    }
    if stop_at_latest:  # a bounded read of what is in the topic now (tests, backfills)
        options["scan.bounded.mode"] = "latest-offset"
    for key, value in {**connector_kafka_properties(kafka.security), **kafka.consumer_properties}.items():
        options[f"properties.{key}"] = value
    with_clause = ",\n  ".join(f"{_sql_string(k)} = {_sql_string(v)}" for k, v in options.items())
    return (
        f"CREATE TEMPORARY TABLE {SOURCE_TABLE} (\n"
        "  `kafka_key` BYTES,\n"
        "  `value` BYTES,\n"
        "  `topic` STRING METADATA VIRTUAL,\n"
        "  `partition` INT METADATA VIRTUAL,\n"
        "  `offset` BIGINT METADATA VIRTUAL,\n"
        "  `ts` TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL\n"
        f") WITH (\n  {with_clause}\n)"
    )


UNKEYED_PREFIX = "(no shopper id) "
"""The partitioning key of a record without a shopper id is this and the record's position
(``partition:offset`` off Kafka), so such records spread over the subtasks like any others instead of
all landing on the one subtask that owns the key "" (a producer bug that sends mostly bad records would
make that one hot key and back-pressure the whole job). The gate dead-letters those records before any
state is read, so a real shopper whose id looks like this shares nothing with them but a subtask."""

SOURCE_QUERY = (
    # The partitioning key, read on the JVM: no Python stage for keying. UNKEYED_PREFIX and the record's
    # position where there is none (the gate dead-letters those records); the gate re-checks that a
    # valid event's id equals its key.
    "SELECT COALESCE(NULLIF(JSON_VALUE(CAST(`value` AS STRING), '$.shopper_id'), ''), "
    f"CONCAT({_sql_string(UNKEYED_PREFIX)}, CAST(`partition` AS STRING), ':', CAST(`offset` AS STRING))) "
    "AS shopper_key, "
    "ROW(`value`, `topic`, `partition`, `offset`, "
    # epoch milliseconds of the Kafka timestamp (the session time zone is UTC: see kafka_source_rows)
    "1000 * UNIX_TIMESTAMP(DATE_FORMAT(`ts`, 'yyyy-MM-dd HH:mm:ss')) + EXTRACT(MILLISECOND FROM `ts`), "
    "`kafka_key`) "
    f"AS record FROM {SOURCE_TABLE}"
)


def table_environment(env: Any) -> Any:
    """The Table API environment over ``env`` that the source and the insights sink share (UTC)."""
    from pyflink.table import StreamTableEnvironment

    t_env = StreamTableEnvironment.create(env)
    t_env.get_config().set("table.local-time-zone", "UTC")
    return t_env


def kafka_source_rows(
    env: Any, settings: NearRealtimeSettings, *, stop_at_latest: bool = False, t_env: Any = None
) -> Any:
    """The events topic as a KeyedStream of ``Row(value, topic, partition, offset, timestamp_ms,
    kafka_key)`` keyed by shopper id, from the official connector's Table API source
    (``kafka_source_ddl``) turned into a DataStream. The key is computed in SQL and the stream is keyed
    with PyFlink's own Java ``KeyByKeySelector`` (field 0 of ``Row(key, record)``, what
    ``DataStream.key_by`` builds after its Python key function), so no Python operator runs before the
    keyed session function.

    Why not the DataStream ``KafkaSource``: from Python it only takes a value-only deserializer, so
    partition, offset and timestamp are lost and a tombstone (null value) fails the job; a
    metadata-aware ``KafkaRecordDeserializationSchema`` would have to be written in Java. The Table
    source is the same connector (``KafkaSource`` inside), with metadata columns and null values built in.
    """
    t_env = t_env or table_environment(env)
    t_env.execute_sql(kafka_source_ddl(settings, stop_at_latest=stop_at_latest))
    from pyflink.common import Types

    record = Types.ROW_NAMED(
        list(SOURCE_COLUMNS),
        [
            Types.PRIMITIVE_ARRAY(Types.BYTE()),
            Types.STRING(),
            Types.INT(),
            Types.LONG(),
            Types.LONG(),
            Types.PRIMITIVE_ARRAY(Types.BYTE()),
        ],
    )
    # A RowTypeInfo stream (to_data_stream would give the Table API's ExternalTypeInfo, which PyFlink's
    # keyed Python operator does not take), shaped as DataStream.key_by's own Row(key, record).
    rows = t_env.to_append_stream(
        t_env.sql_query(SOURCE_QUERY), Types.ROW_NAMED(["shopper_key", "record"], [Types.STRING(), record])
    )
    return keyed_by_field0(rows, record)


def keyed_by_field0(stream: Any, record_type: Any) -> Any:
    """A PyFlink KeyedStream over a DataStream of ``Row(key: STRING, record)``, keyed on the JVM with
    the Java ``KeyByKeySelector`` that ``DataStream.key_by`` uses after its Python key function."""
    from pyflink.common import Types
    from pyflink.datastream.data_stream import KeyedStream
    from pyflink.java_gateway import get_gateway

    j_keyed = stream._j_data_stream.keyBy(
        get_gateway().jvm.KeyByKeySelector(), Types.ROW([Types.STRING()]).get_java_type_info()
    )
    return KeyedStream(j_keyed, record_type, stream)


def kafka_source(settings: NearRealtimeSettings, *, stop_at_latest: bool = False) -> Any:
    """The DataStream ``KafkaSource`` (value-only strings): committed group offsets, earliest for a new
    group, with either connector jar (``committed_offsets_or``). The job reads through
    ``kafka_source_rows`` instead (metadata and tombstones); this stays for DataStream-only users.
    Values are read as UTF-8 strings (``SimpleStringSchema``); invalid bytes become U+FFFD and then
    fail validation into the DLQ. The value-only deserializer does not expose partition/offset.
    """
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer, KafkaSource

    kafka = settings.kafka
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(kafka.bootstrap_servers)
        .set_topics(kafka.events_topic)
        .set_group_id(kafka.group_id)
        .set_starting_offsets(committed_offsets_or("EARLIEST"))
        .set_value_only_deserializer(SimpleStringSchema())
        .set_property("commit.offsets.on.checkpoint", "true")
        .set_property("partition.discovery.interval.ms", "60000")
        .set_property("fetch.max.wait.ms", str(kafka.fetch_max_wait_ms))
    )
    for key, value in {**connector_kafka_properties(kafka.security), **kafka.consumer_properties}.items():
        builder = builder.set_property(key, value)
    if stop_at_latest:  # a bounded read of what is in the topic now (tests, backfills)
        builder = builder.set_bounded(KafkaOffsetsInitializer.latest())
    return builder.build()


def kafka_sink(settings: NearRealtimeSettings, topic: str, *, exactly_once: bool) -> Any:
    """A ``KafkaSink`` of JSON strings, with no key. Exactly-once uses Kafka transactions committed on
    checkpoints, with an explicit ``transaction.timeout.ms`` (the broker caps it at
    ``transaction.max.timeout.ms``). The job writes keyed records instead (``sink_keyed_by_shopper``,
    ``sink_dead_letters``); this stays for DataStream-only users, as ``kafka_source`` does."""
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.base import DeliveryGuarantee
    from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink

    kafka = settings.kafka
    serializer = (
        KafkaRecordSerializationSchema.builder()
        .set_topic(topic)
        .set_value_serialization_schema(SimpleStringSchema())
        .build()
    )
    builder = (
        KafkaSink.builder()
        .set_bootstrap_servers(kafka.bootstrap_servers)
        .set_record_serializer(serializer)
        .set_property("transaction.timeout.ms", str(kafka.transaction_timeout_ms))
    )
    for key, value in connector_kafka_properties(kafka.security).items():
        builder = builder.set_property(key, value)
    if exactly_once:
        builder = builder.set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE).set_transactional_id_prefix(
            kafka.transactional_ids(topic)
        )
    else:
        builder = builder.set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
    return builder.build()


def keyed_sink_ddl(
    settings: NearRealtimeSettings,
    table: str,
    topic: str,
    *,
    exactly_once: bool,
    key: str = "shopper_id",
    key_type: str = "STRING",
) -> str:
    """``CREATE TEMPORARY TABLE`` ``table`` on ``topic``: each record's JSON as the value and its
    ``key`` column as the key (both ``raw``: a STRING as UTF-8 bytes, what the runner's Kafka sink
    writes; BYTES as they are, NULL as no key), placed by Kafka's default partitioner (murmur2 of the
    key). Exactly-once uses Kafka transactions committed on checkpoints, as ``kafka_sink`` does."""
    kafka = settings.kafka
    options: dict[str, str] = {
        "connector": "kafka",
        "topic": topic,
        "properties.bootstrap.servers": kafka.bootstrap_servers,
        "key.format": "raw",
        "key.fields": key,
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
        "properties.transaction.timeout.ms": str(kafka.transaction_timeout_ms),
        "sink.delivery-guarantee": "exactly-once" if exactly_once else "at-least-once",
    }
    if exactly_once:
        options["sink.transactional-id-prefix"] = kafka.transactional_ids(topic)
    for key, value in connector_kafka_properties(kafka.security).items():
        options[f"properties.{key}"] = value
    with_clause = ",\n  ".join(f"{_sql_string(k)} = {_sql_string(v)}" for k, v in options.items())
    return (
        f"CREATE TEMPORARY TABLE {table} (\n"
        f"  `{key}` {key_type},\n"
        "  `value` STRING\n"
        f") WITH (\n  {with_clause}\n)"
    )


def sink_keyed_by_shopper(
    t_env: Any, records: Any, settings: NearRealtimeSettings, topic: str, *, exactly_once: bool, name: str
) -> None:
    """``records`` (a DataStream of JSON strings, each with a ``shopper_id``) onto ``topic`` keyed by
    shopper id, as the runner keys them: per-shopper partitioning for readers (a prompts topic's
    enrichment needs a shopper's prompts on one consumer, for latest wins), and a key a compacted
    topic accepts. ``name`` names the temporary table and view (one pair per sink in a job).

    Why the Table API: PyFlink's DataStream ``KafkaRecordSerializationSchema`` serializes the whole
    element as the key, with no projection to a field. The key is read on the JVM (``JSON_VALUE``), as
    the source's is, and the insert is attached to the DataStream job (``attach_as_datastream``), so it
    runs in the same job and checkpoints."""
    table, view = f"{name}_sink", f"{name}_records"
    t_env.execute_sql(keyed_sink_ddl(settings, table, topic, exactly_once=exactly_once))
    t_env.create_temporary_view(view, t_env.from_data_stream(records))
    statements = t_env.create_statement_set()
    statements.add_insert_sql(f"INSERT INTO {table} SELECT JSON_VALUE(f0, '$.shopper_id'), f0 FROM {view}")
    statements.attach_as_datastream()


DLQ_RECORD = ("kafka_key", "letter")
"""The fields of a DLQ stream's ``Row``: the original record's Kafka key (bytes or ``None``) and its
dead letter's JSON."""


def sink_dead_letters(t_env: Any, letters: Any, settings: NearRealtimeSettings) -> None:
    """``letters`` (a DataStream of ``Row(kafka_key, letter)``, ``DLQ_RECORD``) onto the DLQ topic, each
    dead letter keyed by its original record's Kafka key as it is (no key where it had none), as the
    runner keys it (``runner.dead_letters``): a shopper's dead letters share a partition with each
    other, whichever engine wrote them. At least once, as the runner's DLQ producer. A Table API sink
    for the reason ``sink_keyed_by_shopper`` gives, attached to the DataStream job the same way."""
    table, view = "dead_letters_sink", "dead_letters_records"
    t_env.execute_sql(
        keyed_sink_ddl(
            settings, table, settings.kafka.dlq_topic, exactly_once=False, key="kafka_key", key_type="BYTES"
        )
    )
    t_env.create_temporary_view(view, t_env.from_data_stream(letters))
    statements = t_env.create_statement_set()
    statements.add_insert_sql(f"INSERT INTO {table} SELECT `kafka_key`, `letter` FROM {view}")
    statements.attach_as_datastream()
