"""The Kafka connector jars from PyPI, in a real JVM: provisioned with their pinned checksums, and the
job's committed-offsets-with-earliest-fallback initializer builds with the thin jar (where PyFlink's
own wrapper looks up the SQL jar's shaded class and fails). The job reading from Kafka on a real
cluster is tests/engines/test_engine_agreement.py and tests/flink_jobs/test_flink_cluster.py."""

from __future__ import annotations

import hashlib

import pyflink  # noqa: F401  # the 'flink' extra, which `make test` installs: missing fails, never skips
import pytest

from devstack.flink_jars import missing_or_wrong, provision
from flink_jobs import flink_connectors

pytestmark = [pytest.mark.flink]


def test_the_two_pypi_jars_are_provisioned_with_their_pinned_checksums() -> None:
    jars = provision()
    assert [j.name for j in jars] == list(flink_connectors.PYPI_JARS)
    for jar in jars:
        assert hashlib.sha256(jar.read_bytes()).hexdigest() == flink_connectors.PYPI_JARS[jar.name]
    assert missing_or_wrong(jars[0].parent) == []
    assert flink_connectors.cached_pypi_jars() == jars


def test_committed_offsets_with_earliest_fallback_builds_with_the_thin_jar() -> None:
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.connectors.kafka import KafkaOffsetResetStrategy, KafkaOffsetsInitializer

    env = StreamExecutionEnvironment.get_execution_environment()
    env.add_jars(*(j.resolve().as_uri() for j in provision()))

    initializer = flink_connectors.committed_offsets_or("EARLIEST")
    j_initializer = initializer._j_initializer
    assert j_initializer.getAutoOffsetResetStrategy().name() == "EARLIEST"
    # Why the shim exists: PyFlink's wrapper asks for the SQL jar's shaded enum, absent from the thin jar.
    with pytest.raises(TypeError, match="shaded"):
        KafkaOffsetsInitializer.committed_offsets(KafkaOffsetResetStrategy.EARLIEST)
