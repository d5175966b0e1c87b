"""A start step that fails closes the Kafka clients the steps before it made (``runner.start_cleanup``).

``EmbeddedRunner.run`` makes its two producers (dead letters, repartition), opens the sinks, makes and
subscribes its consumer, enters the LLM client and starts the ops server, all before the try/finally that
closes them. A step that failed there (a sink that cannot open, the metrics port already taken) left
every client made before it open: while the caller held the error (its traceback holds them) each kept
its broker connections, and the consumer joined the group in the background and stayed a member.

Against the stack's real broker, with the step made to fail for real: the metrics port held by a socket of
the test's own (after the consumer subscribed), or an S3 endpoint where nothing listens (the sinks' open,
after the producers were made). What is observed is this process's connections to the broker (from /proc:
``tests.helpers.open_connections``, as ``tests/flink_jobs/test_flink_close`` reads them), while the error
is held: every client, producer or consumer, holds at least one while it lives, whatever the broker. Not
the group: Tansu answers DescribeGroups with a state and no members, and a consumer closed while its first
join is in flight (as here) left a next member of Tansu's group with no partitions for 45 s and more,
where a leaked member let it have half at once: on Tansu the group cannot tell a closed consumer from a
leaked one in bounded time.
"""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from pipeline.sink_retry import SinkRetry
from runner.embedded import EmbeddedRunner
from sinks.errors import S3Unreachable
from tests.conftest import Isolated
from tests.helpers import broker_connections, broker_connections_left

pytestmark = pytest.mark.slow


def test_a_metrics_port_already_taken_closes_the_consumer_and_producers_made_before(
    isolated: Isolated,
) -> None:
    bootstrap = isolated.stack.kafka_bootstrap
    with socket.create_server(("127.0.0.1", 0)) as taken:
        runner = EmbeddedRunner(isolated.runner(metrics_port=taken.getsockname()[1]), log=lambda _: None)
        before = broker_connections(bootstrap)
        with pytest.raises(OSError) as failed:  # held, with its traceback, as a supervisor holds it
            asyncio.run(runner.run())

    assert failed.value.errno == errno.EADDRINUSE, failed.value  # the start step's own error
    left = broker_connections_left(bootstrap, before)
    assert left <= 0, f"{left} broker connections left open by the failed start"
    with pytest.raises(RuntimeError, match="Consumer closed"):
        runner.consumer.memberid()


def test_a_sink_that_cannot_open_closes_the_producers_made_before(isolated: Isolated) -> None:
    """With every sink, the Kafka sink's own producer too (``sinks.kafka``: its ``close`` closes the
    producer; it used to only flush it, and the error's traceback held it through ``Checkpoint.open``)."""
    bootstrap = isolated.stack.kafka_bootstrap
    with socket.create_server(("127.0.0.1", 0)) as listener:
        nothing_listens = listener.getsockname()[1]
    sinks = isolated.sinks().model_copy(
        update={"s3_endpoint_url": f"http://127.0.0.1:{nothing_listens}", "enabled": ("redis", "s3", "kafka")}
    )
    runner = EmbeddedRunner(
        isolated.runner(sinks=sinks, sink_retry=SinkRetry(max_wait_s=1.0)), log=lambda _: None
    )
    before = broker_connections(bootstrap)
    with pytest.raises(S3Unreachable) as failed:  # the start step's own error, held with its traceback
        asyncio.run(runner.run())

    assert f"127.0.0.1:{nothing_listens}" in str(failed.value)
    left = broker_connections_left(bootstrap, before)
    assert left <= 0, f"{left} broker connections left open by the failed start"
