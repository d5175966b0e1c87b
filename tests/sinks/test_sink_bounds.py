"""What a sink keeps and sends is bounded, and a result past a bound never stops the stream: a shopper's
errors hash holds the newest ``signal_errors_max`` records (real Redis), and a result over the Kafka
producer's ``message.max.bytes`` is a counted ``ResultTooLarge``, not a failed write (real broker)."""

from __future__ import annotations

import asyncio
import logging
import random

import orjson
import pytest

from pipeline.checkpoint import Checkpoint
from pipeline.sink_retry import SinkRetry
from prompt_assembly.records import EnrichmentError, request_id
from shopper.readback import read_topic
from sinks.kafka import KafkaResultSink
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated
from tests.sinks.test_sinks import error, insight

EPOCHS = (1_764_000_000_000, 1_764_000_900_000)
"""Two sessions of one shopper (``session_epoch``: the first event's milliseconds)."""


def failed(shopper: str, epoch: int, seq: int) -> EnrichmentError:
    """The error record of the prompt ``(epoch, seq)``, with its real ``request_id``."""
    return error(shopper, seq).model_copy(
        update={"session_epoch": epoch, "request_id": request_id(shopper, epoch, seq)}
    )


async def test_a_shopper_whose_prompts_keep_failing_keeps_only_the_newest_error_records(
    isolated: Isolated,
) -> None:
    """A poison prompt or a long outage: every prompt of a shopper fails. Each error renews the hash's
    TTL, so it never expired and grew a field per failure without bound. It holds the
    ``signal_errors_max`` newest versions now, whatever order the errors come in, and an old error
    replayed later is not kept over a newer one."""
    settings = isolated.sinks().model_copy(update={"signal_errors_max": 3})
    sink = RedisSignalSink(settings)
    versions = [(epoch, seq) for epoch in EPOCHS for seq in range(1, 5)]
    arrivals = random.Random(7).sample(versions, len(versions))
    arrivals += versions[:3]  # the oldest three, replayed after the newer ones
    try:
        await sink.write([failed("s-poison", *v) for v in arrivals[:4]])  # one batch, one pipeline
        for version in arrivals[4:]:
            await sink.write([failed("s-poison", *version)])
        held = await sink.redis.hgetall(sink.keys.signal_errors("s-poison"))  # type: ignore[misc]
        ttl = await sink.redis.ttl(sink.keys.signal_errors("s-poison"))
    finally:
        await sink.close()
    newest = sorted(versions)[-3:]
    assert sorted(held) == sorted(request_id("s-poison", *v).encode() for v in newest)
    assert set(held.values()) == {b"DeadlineExceeded"}
    assert 0 < ttl <= settings.signal_ttl_s
    assert sink.errors_counted == len(arrivals)
    assert sink.errors_dropped == len(arrivals) - 3


PRODUCER_LIMIT = 4_000
"""The producer's ``message.max.bytes`` here: above an ordinary result's record (under 1 kB)."""


async def test_a_result_over_the_producers_size_limit_is_counted_and_the_stream_goes_on(
    isolated: Isolated, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka refuses a record over its ``message.max.bytes`` inside ``produce()``
    (``MSG_SIZE_TOO_LARGE``). The sink's write raised that as it was: the engine retried the whole
    batch for its ``SinkRetry`` and stopped, and a restart met the same result again. The result is a
    ``ResultTooLarge`` now, naming it, its size and the limit: counted, logged, kept; the results
    around it are delivered and the next write goes on."""
    sink = KafkaResultSink(
        isolated.insights_topic,
        {"bootstrap.servers": isolated.stack.kafka_bootstrap, "message.max.bytes": PRODUCER_LIMIT},
        flush_timeout_s=15,
    )
    big = insight("k-big", 1).model_copy(update={"new_event_ids": [f"event-{i:04d}" for i in range(400)]})
    size = len(big.model_dump_json().encode())
    try:
        with caplog.at_level(logging.WARNING, logger="sinks.kafka"):
            await sink.write([insight("k1", 1), big, insight("k2", 1)])
            await sink.flush()
        await sink.write([insight("k3", 1)])
        await sink.flush()
    finally:
        await sink.close()
    assert sink.too_large == 1 and sink.delivered == 3
    # What both engines export (``shopper_results_too_large_total``, Flink's ``results_too_large``).
    assert Checkpoint([sink], SinkRetry()).results_too_large == 1
    [refused] = sink.too_large_recent
    assert (refused.request_id, refused.shopper_id, refused.size, refused.limit) == (
        "k-big:1",
        "k-big",
        size,
        PRODUCER_LIMIT,
    )
    for part in ("'k-big:1'", "'k-big'", f"{size:,} bytes", f"message.max.bytes ({PRODUCER_LIMIT:,})"):
        assert part in str(refused)
    assert [r.getMessage() for r in caplog.records] == [str(refused)]
    values = await asyncio.to_thread(
        read_topic, isolated.stack.kafka_bootstrap, isolated.insights_topic, expect=3
    )
    assert [orjson.loads(v)["request_id"] for v in values] == ["k1:1", "k2:1", "k3:1"]
