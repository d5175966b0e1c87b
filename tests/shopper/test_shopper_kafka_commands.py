"""``shopper produce`` and ``shopper tail-dlq`` talk to Kafka as the runner does: with the runner's
TLS/SASL settings (``RUNNER_KAFKA_SECURITY__*``), and ``tail-dlq`` shows whatever is on the dead-letter
topic, a record that is no dead letter included, one bounded, escaped line each."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from typer.testing import CliRunner

from devstack.stack import StackState
from pipeline.dead_letter import DeadLetter
from pipeline.kafka_security import KafkaSecurity, librdkafka_properties
from pipeline.topics import DLQ_TOPIC
from shopper import flink_cli, producer, readback
from shopper.cli import app
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated
from tests.flink_kit import produce
from tests.runner.test_runner_metrics import older_session_insight
from tests.security_kit import (
    CLIENT_KEY_PASSWORD,
    kafka_config,
    make_certificates,
    mutual_tls,
    tansu_behind_tls,
)

pytestmark = pytest.mark.timeout(300)


def _dead_letter(reason: str, original: str) -> bytes:
    return DeadLetter(
        reason=reason,
        original=original,
        original_encoding="utf-8",
        original_size=len(original),
        original_sha256="0" * 64,
        truncated=False,
    ).to_bytes()


def test_tail_dlq_shows_a_record_that_is_not_a_dead_letter_and_goes_on(stack: StackState) -> None:
    """Records on the real DLQ topic of the test broker: dead letters around raw bytes that are not
    JSON (with a terminal escape sequence), JSON that is not a dead letter, a tombstone and a 200 KB
    reason. Before, the first non-JSON record stopped the command with an orjson error."""
    tag = uuid.uuid4().hex[:8]
    huge = "\x1b[2J" + "R" * 200_000
    records: list[bytes | None] = [
        _dead_letter(f"first-{tag}", "{broken"),
        b"\xff\xfe raw \x1b]0;owned\x07 not json " + tag.encode(),
        b"[1, 2, 3]",
        None,
        _dead_letter(huge, "x" * 10_000),
        _dead_letter(f"last-{tag}", "\u202eevil"),
    ]
    producer_ = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    for value in records:
        producer_.produce(DLQ_TOPIC, value=value)
    assert producer_.flush(30) == 0
    producer_.close()  # CliRunner's result holds this frame in a cycle: left open, it outlived the broker

    result = CliRunner().invoke(
        app, ["tail-dlq", "--bootstrap", stack.kafka_bootstrap, "--limit", str(len(records))]
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    lines = result.output.splitlines()
    assert lines[-1] == f"{len(records)} dead letters shown"
    shown = lines[:-1]
    assert len(shown) == len(records), result.output  # one line each, nothing wrapped
    assert f"first-{tag}" in shown[0] and f"last-{tag}" in shown[-1]
    assert "not a dead letter, not JSON: " in shown[1] and tag in shown[1]
    assert "not a dead letter, no reason: 9 bytes" in shown[2]
    assert "tombstone" in shown[3]
    assert max(len(line) for line in shown) < 400, "bounded"
    assert not any(ch in result.output for ch in "\x1b\x07\u202e"), "escaped: nothing reaches the terminal"
    assert "\\x1b" in shown[1] and "\\u202e" in shown[-1]


class _Recorded(Exception):
    """Raised by the stand-in clients once they have recorded their configuration."""


def test_produce_and_tail_dlq_give_the_runner_security_settings_to_their_clients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SASL_SSL with a client certificate, from the variables the runner reads, reaches the Producer
    of ``produce`` and the Consumer of ``tail-dlq`` key for key (no SASL broker here: the stand-ins
    record the configuration they are given). Before, both built plaintext clients."""
    certs = make_certificates(tmp_path)
    password, key_password = "sasl-Pw-for-cli", "key-Pw-for-cli"
    for name, value in {
        "PROTOCOL": "SASL_SSL",
        "SSL_CA_FILE": str(certs.ca),
        "SSL_CERT_FILE": str(certs.client_cert),
        "SSL_KEY_FILE": str(certs.client_key),
        "SSL_KEY_PASSWORD": key_password,
        "SASL_MECHANISM": "SCRAM-SHA-256",
        "SASL_USERNAME": "cli-user",
        "SASL_PASSWORD": password,
    }.items():
        monkeypatch.setenv(f"RUNNER_KAFKA_SECURITY__{name}", value)
    expected = librdkafka_properties(
        KafkaSecurity(
            protocol="SASL_SSL",
            ssl_ca_file=certs.ca,
            ssl_cert_file=certs.client_cert,
            ssl_key_file=certs.client_key,
            ssl_key_password=key_password,
            sasl_mechanism="SCRAM-SHA-256",
            sasl_username="cli-user",
            sasl_password=password,
        )
    )
    assert expected["sasl.password"] == password and expected["ssl.key.password"] == key_password
    seen: dict[str, dict[str, Any]] = {}

    def recorder(kind: str) -> Any:
        def client(config: dict[str, Any], *args: object, **kwargs: object) -> None:
            seen[kind] = config
            raise _Recorded

        return client

    monkeypatch.setattr(producer, "Producer", recorder("producer"))
    monkeypatch.setattr(readback, "Consumer", recorder("consumer"))
    runner = CliRunner()
    produced = runner.invoke(app, ["produce", "--events", "1", "--bootstrap", "127.0.0.1:1"])
    tailed = runner.invoke(app, ["tail-dlq", "--bootstrap", "127.0.0.1:1"])
    for result in (produced, tailed):
        assert isinstance(result.exception, _Recorded), f"{result.output}\n{result.exception!r}"
    for kind in ("producer", "consumer"):
        assert {k: seen[kind].get(k) for k in expected} == expected, kind
        assert seen[kind]["bootstrap.servers"] == "127.0.0.1:1"


def test_produce_and_tail_dlq_over_mutual_tls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real thing: a Tansu broker reachable only through a TLS terminator that wants a client
    certificate; ``produce`` and ``tail-dlq`` get through with the runner's settings alone."""
    certs = make_certificates(tmp_path / "certs")
    security = mutual_tls(certs)
    monkeypatch.setenv("RUNNER_KAFKA_SECURITY__PROTOCOL", "SSL")
    monkeypatch.setenv("RUNNER_KAFKA_SECURITY__SSL_CA_FILE", str(certs.ca))
    monkeypatch.setenv("RUNNER_KAFKA_SECURITY__SSL_CERT_FILE", str(certs.client_cert))
    monkeypatch.setenv("RUNNER_KAFKA_SECURITY__SSL_KEY_FILE", str(certs.client_key))
    monkeypatch.setenv("RUNNER_KAFKA_SECURITY__SSL_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
    with tansu_behind_tls(tmp_path, certs, require_client_cert=True) as bootstrap:
        secure = kafka_config(bootstrap, security)
        admin = AdminClient(secure)
        for future in admin.create_topics([NewTopic("events-tls", 1, 1), NewTopic(DLQ_TOPIC, 1, 1)]).values():
            future.result(timeout=30)
        dlq = Producer(secure)
        dlq.produce(DLQ_TOPIC, _dead_letter("over-mutual-tls", "{"))
        assert dlq.flush(30) == 0
        # Gone before the commands run: CliRunner's results hold this frame in a reference cycle, so
        # clients left in it outlived the broker and dialled it until a full collection.
        dlq.close()
        del admin, dlq

        runner = CliRunner()
        produced = runner.invoke(
            app, ["produce", "--events", "20", "--topic", "events-tls", "--bootstrap", bootstrap]
        )
        assert produced.exit_code == 0, f"{produced.output}\n{produced.exception!r}"
        assert "produced 20 events" in produced.output
        tailed = runner.invoke(app, ["tail-dlq", "--bootstrap", bootstrap])
        assert tailed.exit_code == 0, f"{tailed.output}\n{tailed.exception!r}"
        assert "over-mutual-tls" in tailed.output and "1 dead letters shown" in tailed.output


def test_the_flink_demos_own_consumers_get_through_mutual_tls(tmp_path: Path) -> None:
    """``shopper demo --engine flink`` waits on the events topic's ends and on the job's committed
    offsets with consumers of its own (``shopper.flink_cli``); with the demo's settings (the runner's,
    as its producer and DLQ reader use) they get through a broker that takes only mutual TLS. Before,
    they connected in plaintext whatever was set, so the demo could not get past its wait."""
    certs = make_certificates(tmp_path / "certs")
    security = mutual_tls(certs)
    topic, group = "events-demo-tls", "demo-flink-tls"
    with tansu_behind_tls(tmp_path, certs, require_client_cert=True) as bootstrap:
        secure = kafka_config(bootstrap, security)
        admin = AdminClient(secure)
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
        ends = produce(bootstrap, topic, [(f"s-{i}".encode(), b"{}") for i in range(10)], config=secure)
        job = Consumer({**secure, "group.id": group, "enable.auto.commit": False})  # the job's commit
        job.commit(offsets=[TopicPartition(topic, p, end) for p, end in ends.items()], asynchronous=False)
        job.close()

        assert flink_cli.topic_ends(bootstrap, topic, idle_s=1.0, security=security) == ends
        flink_cli.wait_group_committed(
            bootstrap, group, topic, ends, lambda: None, within_s=30, security=security
        )


def test_signals_shows_stored_text_as_text(isolated: Isolated, tmp_path: Path) -> None:
    """A shopper id comes from the events topic and a summary from the model: ``shopper signals``
    passed both to Rich as markup (``[/]`` stopped the whole listing with a MarkupError, ``[bold]`` was
    applied) and their escape sequences to the terminal."""
    hostile = {"evil\x1b]0;owned\x07\x1b[2J": "\x1b[31mred\x1b[0m [bold]x[/bold]", "m1": "a [/] b"}
    sink = RedisSignalSink(isolated.sinks())

    async def seed() -> None:
        insights = []
        for shopper, summary in hostile.items():
            insight = older_session_insight(shopper)
            understanding = insight.understanding.model_copy(update={"summary": summary})
            insights.append(insight.model_copy(update={"understanding": understanding, "text": summary}))
        await sink.write(insights)
        await sink.close()

    asyncio.run(seed())
    (tmp_path / "stack.json").write_text(isolated.stack.to_json())
    result = CliRunner().invoke(
        app,
        ["signals", *hostile, "--state-dir", str(tmp_path)],
        env={"RUNNER_SINKS__REDIS_KEY_PREFIX": isolated.prefix},
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "[/]" in result.output and "[bold]x[/bold]" in result.output, "shown as written"
    assert not any(ch in result.output for ch in "\x1b\x07"), "escaped: nothing reaches the terminal"
    assert "\\x1b" in result.output
