"""What the Kafka-protocol broker we run on really does, where tests must know it.

Tansu 0.6.0 serves the records of aborted and fenced transactions to ``read_committed`` consumers
(measured: 8 records seen where Kafka shows 3). A restarted Flink ``KafkaSink`` aborts the transactions
its lost TaskManager left open, so on Tansu a reader can see a replayed insight twice; on Kafka it
cannot. Tests that check exactly-once delivery ask the broker first (``hides_aborted_transactions``)
and are strict wherever the broker can show it.

Older clients: librdkafka before 2.2.0 (Debian 12's ``kcat`` 1.7.1 links 2.0.2) cannot connect to
Tansu 0.6.0 (``ApiVersionRequest failed: Local: Read underflow``). The client is at fault: Tansu's
ApiVersions v3 answer carries its four top-level tagged fields (SupportedFeatures,
FinalizedFeaturesEpoch, FinalizedFeatures, ZkMigrationReady) at their default values, which KIP-482
allows (Kafka itself leaves defaults out), and librdkafka before 2.2.0 skipped one byte too few of
every tagged field (``rd_kafka_buf_skip_tags`` skipped ``size - 1``; fixed by librdkafka commit
8c8f8b9, first released in v2.2.0), so it reads the epoch's ``ff`` bytes as a length. ``api_versions``
asks the broker as such a client does and reads the answer both ways (``read_as_kip_482``,
``read_as_librdkafka_before_2_2``).
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]


def read_committed_sees(bootstrap: str) -> tuple[int, int]:
    """(records a read_committed consumer sees, records it should see) after aborted and fenced
    transactions."""
    topic = f"txn-probe-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(timeout=10)
    first = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-a"})
    first.init_transactions(10)
    for values, commit in ((["aborted"] * 3, False), (["committed"] * 2, True)):
        first.begin_transaction()
        for value in values:
            first.produce(topic, value=value.encode())
        first.flush(10)
        (first.commit_transaction if commit else first.abort_transaction)(10)
    orphan = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-b"})
    orphan.init_transactions(10)
    orphan.begin_transaction()
    for _ in range(2):
        orphan.produce(topic, value=b"open at the crash")
    orphan.flush(10)
    successor = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-b"})
    successor.init_transactions(10)  # fences the orphan and aborts its open transaction
    successor.begin_transaction()
    successor.produce(topic, value=b"after the fence")
    successor.commit_transaction(10)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen = 0
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        message = consumer.poll(0.3)
        if message is not None and not message.error():
            seen += 1
    consumer.close()
    return seen, 3


def hides_aborted_transactions(bootstrap: str) -> bool:
    """True when a ``read_committed`` consumer of this broker sees only committed records."""
    seen, committed = read_committed_sees(bootstrap)
    return seen == committed


# ---- an older client's first request: ApiVersions v3 -------------------------------------------------
API_VERSIONS = 18


class ProtocolUnderflow(ValueError):
    """An answer shorter than what a reader expects to find in it."""


@dataclass(frozen=True)
class ApiVersionsAnswer:
    """A broker's answer to ApiVersions v3, as read by one rule for skipping tagged fields."""

    api_keys: int
    tagged_fields: dict[int, int]
    """Top-level tag -> size in bytes."""


def api_versions(bootstrap: str, timeout_s: float = 5.0) -> bytes:
    """The broker's answer to ApiVersions v3 (after the correlation id), asked as librdkafka asks it
    first on every connection: request header v2 with a client id, then the KIP-511 client software
    name and version."""
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    name, version = b"librdkafka", b"2.0.2"
    header = struct.pack(">hhih", API_VERSIONS, 3, 1, len(b"probe")) + b"probe" + b"\x00"
    body = bytes([len(name) + 1]) + name + bytes([len(version) + 1]) + version + b"\x00"
    request = header + body
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _read_exactly(sock, 4))
        answer = _read_exactly(sock, size)
    return answer[4:]  # ApiVersions answers carry header v0: only the correlation id


def read_as_kip_482(answer: bytes) -> ApiVersionsAnswer:
    """Read the answer as the protocol says: a tagged field's size is its number of bytes."""
    return _read_api_versions_v3(answer, skip=lambda size: size)


def read_as_librdkafka_before_2_2(answer: bytes) -> ApiVersionsAnswer:
    """Read the answer as librdkafka before 2.2.0 did: ``size - 1`` bytes skipped per tagged field
    (``rd_kafka_buf_skip_tags`` in librdkafka 2.0.2's ``src/rdkafka_buf.h``)."""
    return _read_api_versions_v3(answer, skip=lambda size: size - 1 if size > 1 else 0)


def _read_api_versions_v3(answer: bytes, skip: Callable[[int], int]) -> ApiVersionsAnswer:
    reader = _Reader(answer)
    reader.take(2)  # error code
    api_keys = reader.uvarint() - 1
    for _ in range(api_keys):
        reader.take(6)  # api key, min and max version
        _skip_tags(reader, skip)
    reader.take(4)  # throttle time
    tagged = _skip_tags(reader, skip)
    if reader.left:
        raise ProtocolUnderflow(f"{reader.left} bytes left unread at the end")
    return ApiVersionsAnswer(api_keys, tagged)


def _skip_tags(reader: _Reader, skip: Callable[[int], int]) -> dict[int, int]:
    tags = {}
    for _ in range(reader.uvarint()):
        tag, size = reader.uvarint(), reader.uvarint()
        reader.take(skip(size))
        tags[tag] = size
    return tags


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise ProtocolUnderflow(f"expected {n} bytes at {self.at}, {self.left} remain")
        piece = self.data[self.at : self.at + n]
        self.at += n
        return piece

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            (byte,) = self.take(1)
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise ConnectionError(f"the broker closed the connection after {len(data)} of {n} bytes")
        data += piece
    return data


def old_librdkafka_connects(bootstrap: str) -> bool:
    """Whether librdkafka before 2.2.0 (e.g. Debian 12's kcat) can read this broker's first answer."""
    try:
        read_as_librdkafka_before_2_2(api_versions(bootstrap))
    except ProtocolUnderflow:
        return False
    return True


if __name__ == "__main__":  # pragma: no cover - a person's check: python -m devstack.broker_probe HOST:PORT
    import sys

    target = sys.argv[1]
    raw = api_versions(target)
    spec = read_as_kip_482(raw)
    print(
        f"ApiVersions v3: {spec.api_keys} API keys, top-level tagged fields (tag: bytes) {spec.tagged_fields}"
    )
    print(f"librdkafka >= 2.2 reads it: yes; librdkafka < 2.2 reads it: {old_librdkafka_connects(target)}")
    print(f"read_committed hides aborted transactions: {hides_aborted_transactions(target)}")
