"""What a Kafka consumer error means for the embedded runner: wait it out, or stop.

librdkafka reports errors two ways: as error events among the consumed messages (a subscribed topic
that is unknown, an authorisation failure), and through ``error_cb`` (connection, TLS and SASL
failures, fatal errors), which nothing sees unless a callback is set. Before, the runner logged the
first kind and never saw the second, so a wrong topic or security setting never failed it and
``--until-drained`` never returned. Now every error is classified here:

- ``transient``: a broker restarting or unreachable (``_TRANSPORT``, ``_ALL_BROKERS_DOWN``, ...) and
  anything not named below. Logged; librdkafka reconnects and the runner waits, as it waits for a store
  that is down (the fault suite restarts brokers mid-stream).
- ``fatal`` (``err.fatal()``), ``denied`` (authorisation or authentication refused, a TLS handshake
  failure): no retry helps. The runner stops with ``ConsumerFailed``, naming the setting to check.
- ``unknown_topic``: librdkafka reports a topic unknown until its metadata reaches the client, so a
  topic created just before the runner starts can be reported missing once. The runner stops only when
  the broker still does not know the topic ``unknown_topic_grace_s`` after the first report
  (``UnknownTopicWatch``).
- ``ignored``: ``_PARTITION_EOF``, an event rather than an error (the runner does not ask for it).

Everything here is pure: the runner does the I/O (reading the errors, asking the broker again).
"""

from __future__ import annotations

from typing import Literal

from confluent_kafka import KafkaError

from runner.errors import ConsumerFailed

ConsumerErrorKind = Literal["transient", "fatal", "denied", "unknown_topic", "ignored"]

UNKNOWN_TOPIC = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
AUTHORISATION = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)
AUTHENTICATION = frozenset({KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION})
TLS = frozenset({KafkaError._SSL})
"""A TLS handshake that fails for a reason of its own (an untrusted certificate, a name mismatch);
librdkafka reports a connection lost during the handshake as ``_TRANSPORT``, which stays transient."""

_SECURITY = "RUNNER_KAFKA_SECURITY__"


def classify(error: KafkaError) -> ConsumerErrorKind:
    if error.fatal():
        return "fatal"
    code = error.code()
    if code == KafkaError._PARTITION_EOF:
        return "ignored"
    if code in AUTHORISATION or code in AUTHENTICATION or code in TLS:
        return "denied"
    if code in UNKNOWN_TOPIC:
        return "unknown_topic"
    return "transient"


def consumer_failed(error: KafkaError, *, topic: str, group_id: str, bootstrap: str) -> ConsumerFailed:
    """The ``ConsumerFailed`` for an error ``classify`` calls fatal or denied: what failed, and the
    runner setting a person should check."""
    code, text = error.code(), error.str()
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        setting = "RUNNER_TOPIC"
        what = f"not authorised to read topic {topic!r}: {text}; check the topic's ACLs for this user"
    elif code == KafkaError.GROUP_AUTHORIZATION_FAILED:
        setting = "RUNNER_GROUP_ID"
        what = f"not authorised to use consumer group {group_id!r}: {text}; check the group's ACLs"
    elif code == KafkaError.CLUSTER_AUTHORIZATION_FAILED:
        setting = f"{_SECURITY}SASL_USERNAME"
        what = f"not authorised on the cluster at {bootstrap}: {text}"
    elif code in AUTHENTICATION:
        setting = f"{_SECURITY}SASL_MECHANISM / SASL_USERNAME / SASL_PASSWORD"
        what = f"authentication to {bootstrap} failed: {text}"
    elif code in TLS:
        setting = f"{_SECURITY}SSL_CA_FILE (and SSL_CERT_FILE, SSL_KEY_FILE, SSL_VERIFY_HOSTNAME)"
        what = f"TLS to {bootstrap} failed: {text}"
    else:
        setting = None
        what = f"fatal consumer error ({error.name()}): {text}"
    hint = f"; check {setting}" if setting is not None else ""
    return ConsumerFailed(
        f"Kafka consumer failed, the runner stops: {what}{hint}",
        code=error.name(),
        setting=setting,
        topic=topic if code == KafkaError.TOPIC_AUTHORIZATION_FAILED else None,
    )


def topic_missing(topic: str, bootstrap: str, waited_s: float) -> ConsumerFailed:
    return ConsumerFailed(
        f"Kafka consumer failed, the runner stops: topic {topic!r} does not exist on {bootstrap} "
        f"(still unknown {waited_s:.0f} s after the first report); check RUNNER_TOPIC, or create the "
        "topic (the runner never creates it)",
        code="UNKNOWN_TOPIC_OR_PART",
        setting="RUNNER_TOPIC",
        topic=topic,
    )


class UnknownTopicWatch:
    """The time since the subscribed topic was first reported unknown, while it is.

    librdkafka reports an unknown subscribed topic once, not on every poll, so the runner cannot wait
    for the error to stop repeating: once ``grace_s`` has passed since the first report it asks the
    broker again (``due``), and either fails or ``clear``s the watch."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: float | None = None

    def reported(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def clear(self) -> None:
        self.since = None

    def due(self, now: float) -> bool:
        return self.since is not None and now - self.since >= self.grace_s

    def waited(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since
