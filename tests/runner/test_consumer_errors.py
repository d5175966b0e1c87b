"""Consumer errors no retry can fix stop the runner with ``ConsumerFailed``.

Before, every consumer error was logged and skipped, and librdkafka's own errors (TLS, SASL, fatal)
reached no one at all: a runner pointed at a wrong topic or with a wrong CA polled forever, and
``--until-drained`` never returned. Against the real broker: a topic that does not exist (and is not
created by the runner: auto-creation is off) and a broker certificate the runner does not trust both
end the run, within a bound, with an error that names the setting to fix. The classification itself
is pure and checked without a broker: transient errors (a broker restarting) stay transient.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient

from devstack.stack import StackState
from pipeline.kafka_security import KafkaSecurity, librdkafka_properties
from runner.consumer_errors import UnknownTopicWatch, classify, consumer_failed
from runner.embedded import EmbeddedRunner
from runner.errors import ConsumerFailed, RunnerError
from runner.repartition import ensure_topic
from tests.conftest import Isolated
from tests.security_kit import TestCertificates, make_certificates, tansu_behind_tls

BOUND_S = 60.0
"""Far longer than a failing runner needs (its grace period plus a group join), far shorter than
'forever': the old runner ran into it."""


def run_bounded(runner: EmbeddedRunner) -> float:
    """Run ``runner`` for at most ``BOUND_S``; returns the seconds it ran (it raises to pass)."""

    async def bounded() -> None:
        async with asyncio.timeout(BOUND_S):
            await runner.run()

    started = time.monotonic()
    asyncio.run(bounded())
    return time.monotonic() - started


@pytest.mark.slow
def test_a_topic_that_does_not_exist_stops_the_runner_instead_of_hanging(stack: StackState) -> None:
    iso = Isolated(stack)  # its names only: the topics are never created
    lines: list[str] = []
    runner = EmbeddedRunner(iso.runner(unknown_topic_grace_s=2.0), log=lines.append)

    started = time.monotonic()
    with pytest.raises(ConsumerFailed) as failed:
        run_bounded(runner)

    assert time.monotonic() - started < BOUND_S
    assert failed.value.topic == iso.topic and failed.value.setting == "RUNNER_TOPIC"
    assert iso.topic in str(failed.value) and "RUNNER_TOPIC" in str(failed.value)
    assert failed.value.code == "UNKNOWN_TOPIC_OR_PART"
    assert isinstance(failed.value, RunnerError)
    assert runner.stats.commits == 0
    topics = AdminClient({"bootstrap.servers": stack.kafka_bootstrap}).list_topics(timeout=10).topics
    assert iso.topic not in topics, "the runner must never create the topic it was pointed at"


@pytest.mark.slow
def test_a_broker_certificate_the_runner_does_not_trust_stops_it_naming_the_ca_setting(
    stack: StackState, tmp_path: Path
) -> None:
    """The broker's certificate is signed by one CA; the runner trusts another. The handshake
    failure (``_SSL``) comes only through librdkafka's ``error_cb``."""
    certs = make_certificates(tmp_path / "broker-ca")
    other = make_certificates(tmp_path / "other-ca")
    iso = Isolated(stack)
    with tansu_behind_tls(tmp_path, certs) as bootstrap:
        security = KafkaSecurity(protocol="SSL", ssl_ca_file=other.ca)
        runner = EmbeddedRunner(
            iso.runner(bootstrap_servers=bootstrap, kafka_security=security), log=lambda _: None
        )
        with pytest.raises(ConsumerFailed) as failed:
            run_bounded(runner)
    assert failed.value.code == "_SSL"
    assert failed.value.setting is not None and "SSL_CA_FILE" in failed.value.setting
    assert bootstrap in str(failed.value)


class HandshakeCounter:
    """A TLS listener on 127.0.0.1 with ``certs``' server certificate that counts every connection
    made to it; it answers no Kafka request."""

    def __init__(self, certs: TestCertificates) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs.cert, certs.key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        self.stopped = threading.Event()

    def serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(2.0)
            try:  # the client refuses the certificate: that handshake failure is what it reports
                self.context.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                conn.close()


@contextmanager
def handshake_counter(certs: TestCertificates) -> Iterator[HandshakeCounter]:
    counter = HandshakeCounter(certs)
    thread = threading.Thread(target=counter.serve, name="tls-listener", daemon=True)
    thread.start()
    try:
        yield counter
    finally:
        counter.stopped.set()
        thread.join(5)
        counter.listener.close()


@pytest.mark.slow
def test_a_refused_tls_handshake_at_start_leaves_no_client_connecting(tmp_path: Path) -> None:
    """``ensure_topic`` (the runner's first step) stops on a broker certificate it does not trust,
    and its admin client stops with it, even while the ``ConsumerFailed`` and its traceback are
    held (as a caller that logs or re-raises it holds them). Before, the traceback kept the client
    alive: it went on connecting, and logging each refusal to stderr, until the process ended."""
    certs = make_certificates(tmp_path / "broker-ca")
    other = make_certificates(tmp_path / "other-ca")
    security = KafkaSecurity(protocol="SSL", ssl_ca_file=other.ca)
    with handshake_counter(certs) as broker:
        bootstrap = f"127.0.0.1:{broker.port}"
        kafka = {
            "bootstrap.servers": bootstrap,
            **librdkafka_properties(security),
            "log_level": 0,  # its refusals are counted here, not printed
        }
        lines: list[str] = []
        with pytest.raises(ConsumerFailed) as failed:
            ensure_topic(kafka, "events", "events.g.repartition", group_id="g", grace_s=1.0, log=lines.append)
        assert failed.value.code == "_SSL" and broker.connections >= 1
        time.sleep(0.5)  # a connection already under way when it returned
        settled = broker.connections
        time.sleep(2.0)  # a client left alive reconnected about once a second (2 or 3 in this window)
        assert broker.connections == settled, (
            f"{broker.connections - settled} connections after ensure_topic returned"
        )


def test_only_errors_no_retry_can_fix_are_fatal() -> None:
    def kind(code: int, *, fatal: bool = False) -> str:
        return classify(KafkaError(code, "reason", fatal=fatal))

    for code in (
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError._AUTHENTICATION,
        KafkaError._SSL,
    ):
        assert kind(code) == "denied", KafkaError(code).name()
    assert kind(KafkaError._FATAL, fatal=True) == "fatal"
    assert kind(KafkaError._TRANSPORT, fatal=True) == "fatal", "fatal() decides, whatever the code"
    assert kind(KafkaError.UNKNOWN_TOPIC_OR_PART) == kind(KafkaError._UNKNOWN_TOPIC) == "unknown_topic"
    # A broker restarting (the fault suite's case a): waited for, never fatal.
    for code in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError.NOT_COORDINATOR):
        assert kind(code) == "transient", KafkaError(code).name()
    assert kind(KafkaError._PARTITION_EOF) == "ignored"


def test_each_failure_names_what_to_check() -> None:
    def failure(code: int) -> ConsumerFailed:
        return consumer_failed(
            KafkaError(code, "broker said no"), topic="events", group_id="g", bootstrap="b:9093"
        )

    topic = failure(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert topic.topic == "events" and topic.setting == "RUNNER_TOPIC" and "'events'" in str(topic)
    assert failure(KafkaError.GROUP_AUTHORIZATION_FAILED).setting == "RUNNER_GROUP_ID"
    assert "SASL_PASSWORD" in str(failure(KafkaError._AUTHENTICATION).setting)
    assert "SSL_CA_FILE" in str(failure(KafkaError._SSL).setting)
    assert "broker said no" in str(failure(KafkaError._SSL)) and "b:9093" in str(failure(KafkaError._SSL))


def test_an_unknown_topic_is_given_its_grace_period_from_the_first_report() -> None:
    watch = UnknownTopicWatch(grace_s=30.0)
    assert not watch.due(1e9)
    watch.reported(100.0)
    watch.reported(120.0)  # a later report does not restart the period
    assert not watch.due(129.9) and watch.due(130.0)
    watch.clear()  # the broker knows the topic now
    assert not watch.due(1e9)
