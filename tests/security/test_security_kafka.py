"""Kafka TLS against a real broker (Tansu behind a socat TLS terminator, CA made by the test), and the
SASL settings reaching both clients' properties unchanged (no SASL-capable broker here; see
docs/security.md)."""

from __future__ import annotations

import json
import re
import uuid
import zipfile
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from pydantic import SecretStr
from typer.testing import CliRunner

from flink_jobs import flink_connectors
from flink_jobs.flink_config import NearRealtimeSettings
from pipeline.kafka_security import (
    SHADED_PREFIX,
    InsecureConfiguration,
    KafkaSecurity,
    java_kafka_properties,
    librdkafka_properties,
)
from prompt_assembly.errors import ConfigurationError
from runner.config import RunnerSettings
from shopper.cli import app
from tests.security_kit import (
    kafka_config,
    make_certificates,
    mutual_tls,
    tansu_behind_tls,
)

pytestmark = pytest.mark.timeout(180)


def test_tls_produce_and_consume_through_the_runner_settings(tmp_path: Path) -> None:
    """The runner's settings, turned into librdkafka properties, produce and consume over TLS; the same
    client without the CA cannot even list topics."""
    certs = make_certificates(tmp_path / "certs")
    with tansu_behind_tls(tmp_path, certs) as bootstrap:
        settings = RunnerSettings(
            bootstrap_servers=bootstrap,
            kafka_security=KafkaSecurity(protocol="SSL", ssl_ca_file=certs.ca),
        )
        secure: dict[str, str | int | float | bool] = {
            "bootstrap.servers": bootstrap,
            **librdkafka_properties(settings.kafka_security),
        }
        assert secure["security.protocol"] == "ssl"
        assert secure["ssl.ca.location"] == str(certs.ca.resolve())

        topic = f"tls-{uuid.uuid4().hex[:8]}"
        admin = AdminClient(secure)
        for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
            future.result(timeout=30)
        producer = Producer({**secure, "linger.ms": 5})
        sent = [f"event-{i}".encode() for i in range(50)]
        for value in sent:
            producer.produce(topic, value)
        assert producer.flush(30) == 0

        consumer = Consumer({**secure, "group.id": f"g-{topic}", "enable.auto.commit": False})
        consumer.assign([TopicPartition(topic, 0, 0)])
        received: list[bytes] = []
        try:
            for _ in range(200):
                message = consumer.poll(0.2)
                if message is not None and message.error() is None:
                    received.append(message.value() or b"")
                if len(received) == len(sent):
                    break
        finally:
            consumer.close()
        assert received == sent

        # Without the test CA the broker's certificate is not trusted: no connection at all.
        untrusting: dict[str, str | int | float | bool] = {
            "bootstrap.servers": bootstrap,
            "security.protocol": "ssl",
            "socket.timeout.ms": 3000,
        }
        with pytest.raises(KafkaException):
            AdminClient(untrusting).list_topics(timeout=5)
        # And a plaintext client does not get through the TLS port either.
        with pytest.raises(KafkaException):
            AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 3000}).list_topics(timeout=5)


def test_mutual_tls_with_an_encrypted_client_key(tmp_path: Path) -> None:
    """A terminator that requires a client certificate from the CA: the runner's settings with the
    client certificate and its encrypted key (``ssl_key_password``) produce; without them, or with
    the wrong key password, nothing gets through."""
    certs = make_certificates(tmp_path / "certs")
    with tansu_behind_tls(tmp_path, certs, require_client_cert=True) as bootstrap:
        security = mutual_tls(certs)
        secure = kafka_config(bootstrap, security)
        topic = f"mtls-{uuid.uuid4().hex[:8]}"
        admin = AdminClient(secure)  # kept referenced until its futures resolve
        for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
            future.result(timeout=30)
        producer = Producer(secure)
        producer.produce(topic, b"over mutual TLS")
        assert producer.flush(30) == 0

        server_only = librdkafka_properties(KafkaSecurity(protocol="SSL", ssl_ca_file=certs.ca))
        with pytest.raises(KafkaException):
            AdminClient(
                {"bootstrap.servers": bootstrap, **server_only, "socket.timeout.ms": 3000}
            ).list_topics(timeout=5)
        with pytest.raises(KafkaException):  # librdkafka cannot read the key: no client at all
            AdminClient({**secure, "ssl.key.password": "wrong"}).list_topics(timeout=5)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_settings_reach_librdkafka_and_the_flink_connector_unchanged(
    tmp_path: Path, mechanism: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the environment (as an operator sets them) to each client's properties, byte for byte,
    including a password with JAAS-special characters."""
    certs = make_certificates(tmp_path)
    password = 'p"a\\ss w;rd=ü'
    for prefix in ("RUNNER_KAFKA_SECURITY__", "FLINK_JOB_KAFKA__SECURITY__"):
        monkeypatch.setenv(prefix + "PROTOCOL", "SASL_SSL")
        monkeypatch.setenv(prefix + "SSL_CA_FILE", str(certs.ca))
        monkeypatch.setenv(prefix + "SASL_MECHANISM", mechanism)
        monkeypatch.setenv(prefix + "SASL_USERNAME", "shopper-app")
        monkeypatch.setenv(prefix + "SASL_PASSWORD", password)

    runner = librdkafka_properties(RunnerSettings().kafka_security)
    assert runner == {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(certs.ca.resolve()),
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": mechanism,
        "sasl.username": "shopper-app",
        "sasl.password": password,
    }
    Producer({"bootstrap.servers": "127.0.0.1:1", **runner})  # librdkafka accepts every key and value

    flink = java_kafka_properties(NearRealtimeSettings().kafka.security, shaded=True)  # the SQL jar
    module = "scram.ScramLoginModule" if mechanism.startswith("SCRAM") else "plain.PlainLoginModule"
    assert flink == {
        "security.protocol": "SASL_SSL",
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(certs.ca.resolve()),
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": mechanism,
        "sasl.jaas.config": f"{SHADED_PREFIX}org.apache.kafka.common.security.{module} required "
        'username="shopper-app" password="p\\"a\\\\ss w;rd=ü";',
    }


def test_invalid_combinations_fail_at_start(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    with pytest.raises(ConfigurationError, match="needs sasl_mechanism"):
        KafkaSecurity(protocol="SASL_SSL")
    with pytest.raises(InsecureConfiguration, match="ssl_ca_file set but protocol is PLAINTEXT"):
        KafkaSecurity(ssl_ca_file=certs.ca)
    with pytest.raises(ConfigurationError, match="both ssl_cert_file and ssl_key_file"):
        KafkaSecurity(protocol="SSL", ssl_cert_file=certs.cert)
    with pytest.raises(ConfigurationError, match="ssl_ca_file"):
        KafkaSecurity(protocol="SSL", ssl_ca_file=tmp_path / "missing.crt")
    with pytest.raises(ConfigurationError, match="sasl_password set but protocol is SSL"):
        KafkaSecurity(protocol="SSL", sasl_password=SecretStr("unused"))
    assert (
        librdkafka_properties(KafkaSecurity()) == {} == java_kafka_properties(KafkaSecurity(), shaded=False)
    )


SECRET = "insecure-PLANT-31c9"


@pytest.mark.parametrize(
    ("protocol", "setting"),
    [
        ("PLAINTEXT", "ssl_key_password"),
        ("PLAINTEXT", "sasl_password"),
        ("SASL_PLAINTEXT", "ssl_key_password"),
    ],
)
def test_a_secret_on_a_plaintext_protocol_fails_at_start(
    protocol: str, setting: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Kafka SSL key password, or a SASL password without SASL, on a protocol that would send
    nothing encrypted: ``InsecureConfiguration`` (a ``ConfigurationError``) when the settings are read,
    naming the setting and never its value: built directly, from the runner's variables (as every
    ``shopper`` command reads them) and from the Flink job's config file. Before, both were accepted
    and silently unused: the operator believed the connection protected. (A SASL password with
    ``SASL_PLAINTEXT`` is that protocol's own setting and stays allowed.)"""
    extra: dict[str, object] = {setting: SECRET}
    if protocol == "SASL_PLAINTEXT":
        extra |= {"sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u", "sasl_password": "p"}
    with pytest.raises(InsecureConfiguration, match=setting) as raised:
        KafkaSecurity(protocol=protocol, **extra)
    assert isinstance(raised.value, ConfigurationError) and SECRET not in str(raised.value)

    for name, item in {"protocol": protocol, **extra}.items():
        monkeypatch.setenv(f"RUNNER_KAFKA_SECURITY__{name.upper()}", str(item))
    for command in (["produce", "--bootstrap", "127.0.0.1:1"], ["run", "--no-from-stack"]):
        result = CliRunner().invoke(app, command)
        assert isinstance(result.exception, InsecureConfiguration), f"{command}: {result.exception!r}"
        message = str(result.exception)
        assert f"kafka_security: {setting}" in message or (
            "kafka_security:" in message and setting in message
        ), message
        assert SECRET not in message + result.output

    config = tmp_path / "job.json"
    config.write_text(json.dumps({"kafka": {"security": {"protocol": protocol, **extra}}}))
    with pytest.raises(InsecureConfiguration, match=rf"kafka\.security: .*{setting}") as raised:
        NearRealtimeSettings.load(config)
    assert SECRET not in str(raised.value)


def test_flink_login_module_is_a_class_in_the_jars_on_the_classpath(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The JAAS line of the job's Kafka source (its SQL DDL, ``properties.sasl.jaas.config``) names a
    login module class that the connector jars the job would load actually contain: the thin
    ``flink-connector-kafka`` + plain ``kafka-clients`` jars from PyPI (``python -m devstack.flink_jars``)
    hold ``org.apache.kafka.common.security...``, not the SQL jar's shaded name. Before, the job always
    named the shaded class, and a SASL job on these jars could not log in (JAAS: class not found)."""
    from devstack.flink_jars import provision

    monkeypatch.delenv("FLINK_CONNECTOR_JARS", raising=False)
    if not sorted(flink_connectors.LIB_DIR.glob(flink_connectors.JAR_GLOB)):
        provision()  # idempotent; what `make test` does first
    jars = flink_connectors.find_kafka_connector_jars()
    assert jars, "no connector jars"
    for mechanism in ("PLAIN", "SCRAM-SHA-512"):
        settings = NearRealtimeSettings(
            kafka={
                "security": {
                    "protocol": "SASL_SSL",
                    "sasl_mechanism": mechanism,
                    "sasl_username": "job",
                    "sasl_password": "pw",
                }
            }
        )
        ddl = flink_connectors.kafka_source_ddl(settings)
        match = re.search(r"'properties\.sasl\.jaas\.config' = '(\S+) required ", ddl)
        assert match, ddl
        entry = match.group(1).replace(".", "/") + ".class"
        holders = []
        for jar in jars:
            with zipfile.ZipFile(jar) as archive:
                if entry in archive.namelist():
                    holders.append(jar.name)
        assert holders, f"{match.group(1)} is in none of {[j.name for j in jars]}"


def test_shading_is_read_from_the_jars(tmp_path: Path) -> None:
    """The SQL uber jar (relocated client) and the thin pair are told apart by their entries."""
    plain = "org/apache/kafka/common/security/plain/PlainLoginModule.class"
    uber, thin, connector = tmp_path / "uber.jar", tmp_path / "kafka-clients.jar", tmp_path / "c.jar"
    for jar, entries in ((uber, [SHADED_PREFIX.replace(".", "/") + plain]), (thin, [plain]), (connector, [])):
        with zipfile.ZipFile(jar, "w") as archive:
            for entry in [*entries, "META-INF/MANIFEST.MF"]:
                archive.writestr(entry, b"")
    assert flink_connectors.kafka_clients_shaded([uber]) is True
    assert flink_connectors.kafka_clients_shaded([connector, thin]) is False
    with pytest.raises(flink_connectors.MissingConnectorJar):
        flink_connectors.kafka_clients_shaded([connector])
