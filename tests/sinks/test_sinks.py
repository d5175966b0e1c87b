"""Sinks against real Redis and the moto S3 server: newer-version-wins signals, TTL, idempotent
error bookkeeping, deterministic S3 keys (a retried flush overwrites), partitions by event time."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import boto3
import orjson
import pytest
from aiohttp import web
from botocore.exceptions import ClientError
from confluent_kafka import KafkaError, Message

from prompt_assembly.records import EnrichmentError, ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding
from shopper.readback import READ_BATCH, read_signals, signal_age
from sinks.config import SinkSettings
from sinks.errors import SinkWriteFailed
from sinks.kafka import KafkaResultSink
from sinks.redis import RedisSignalSink
from sinks.s3 import S3InsightSink
from tests.conftest import Isolated
from tests.helpers import broker_connections, broker_connections_left, serving
from tests.slow_link import tansu_behind_slow_link


def insight(
    shopper: str, seq: int, summary: str = "Likes hats.", ts: float = 1_761_800_000.0
) -> ShopperInsight:
    return ShopperInsight(
        request_id=f"{shopper}:{seq}",
        shopper_id=shopper,
        seq=seq,
        reason="add_to_cart",
        understanding=ShopperUnderstanding(
            interests=["hats"], occasion=None, style="fun", price_sensitivity="low", summary=summary
        ),
        text=summary,
        model="m",
        replica="r0",
        usage=Usage(prompt_tokens=100, cached_tokens=90, completion_tokens=20),
        event_count=3,
        last_event_ts=ts,
        ttft_ms=5,
        latency_ms=50,
        attempts=1,
        produced_at=time.time(),
    )


def error(shopper: str, seq: int) -> EnrichmentError:
    return EnrichmentError(
        request_id=f"{shopper}:{seq}",
        shopper_id=shopper,
        seq=seq,
        reason="purchase",
        error_type="DeadlineExceeded",
        message="slow",
        attempts=3,
        last_event_ts=1.7e9,
        produced_at=time.time(),
    )


async def test_redis_keeps_the_newest_version(isolated: Isolated) -> None:
    sink = RedisSignalSink(isolated.sinks())
    try:
        await sink.write([insight("s1", 2, "second")])
        await sink.write([insight("s1", 1, "first, replayed late"), insight("s1", 2, "second, duplicate")])
        stored = await sink.read("s1")
        assert (stored["seq"], stored["summary"]) == ("2", "second")
        await sink.write([insight("s1", 3, "third")])
        assert (await sink.read("s1"))["summary"] == "third"
        assert sink.written == 2 and sink.stale_skipped == 2
        ttl = await sink.redis.ttl(sink.key("s1"))
        assert 0 < ttl <= isolated.sinks().signal_ttl_s
        assert orjson.loads((await sink.read("s1"))["interests"]) == ["hats"]
    finally:
        await sink.close()


async def test_errors_do_not_overwrite_signals_and_count_once(isolated: Isolated) -> None:
    sink = RedisSignalSink(isolated.sinks())
    try:
        await sink.write([insight("s2", 1, "good")])
        await sink.write([error("s2", 2)])
        await sink.write([error("s2", 2)])  # replayed
        assert (await sink.read("s2"))["summary"] == "good"
        errors = await sink.redis.hgetall(f"{isolated.prefix}signal_errors:s2")  # type: ignore[misc]
        assert errors == {b"s2:2": b"DeadlineExceeded"}
    finally:
        await sink.close()


async def test_error_records_expire_with_the_signals(isolated: Isolated) -> None:
    """A shopper who goes quiet leaves no error hash behind: it gets the signals' TTL, in the same
    script call as the write (no window in which the hash exists without an expiry)."""
    settings = isolated.sinks().model_copy(update={"signal_ttl_s": 600})
    sink = RedisSignalSink(settings)
    try:
        await sink.write([error("s3", 1)])
        key = sink.keys.signal_errors("s3")
        assert 0 < await sink.redis.ttl(key) <= 600
        await sink.redis.expire(key, 5)
        await sink.write([error("s3", 2), insight("s3", 3)])  # a later error renews it, as signals do
        assert 5 < await sink.redis.ttl(key) <= 600
        assert await sink.redis.hlen(key) == 2  # type: ignore[misc]
        assert sink.errors_counted == 2
    finally:
        await sink.close()


def s3_objects(isolated: Isolated) -> dict[str, list[dict[str, object]]]:
    settings = isolated.sinks()
    s3 = boto3.client("s3", **settings.s3_client_kwargs())
    listing = s3.list_objects_v2(Bucket=settings.s3_bucket, Prefix=isolated.s3_prefix).get("Contents", [])
    return {
        o["Key"]: [
            orjson.loads(line)
            for line in gzip.decompress(
                s3.get_object(Bucket=settings.s3_bucket, Key=o["Key"])["Body"].read()
            ).splitlines()
        ]
        for o in listing
    }


async def test_s3_batches_are_partitioned_and_retried_flushes_overwrite(isolated: Isolated) -> None:
    sink = S3InsightSink(isolated.sinks())
    await sink.ensure_bucket()
    batch: list[ShopperInsight | EnrichmentError] = [
        insight("a", 1),
        insight("b", 1, ts=1_761_800_000.0 + 3600),
        error("c", 1),
    ]
    try:
        await sink.write(batch)
        assert sink.buffered == 3
        await sink.flush()
        first = s3_objects(isolated)
        await sink.write(batch)  # the same results again, as after a retried flush
        await sink.flush()
        again = s3_objects(isolated)
    finally:
        await sink.close()
    assert first.keys() == again.keys() and len(first) == 3  # two insight hours + one error partition
    assert sum(len(v) for v in again.values()) == 3
    assert any("/kind=error/" in key for key in again)
    assert any("/hour=04/" in key for key in again) and any("/hour=05/" in key for key in again)


async def test_a_shopper_id_with_a_newline_never_shares_another_batchs_object(isolated: Isolated) -> None:
    """A shopper id may hold a newline (the event schema allows any text): joined by newlines, the one
    id ``"a:1\nb:1"`` read as the two ids ``a:1`` and ``b:1``, both flushes got one key, and the
    second object replaced the first, its records gone from S3."""
    sink = S3InsightSink(isolated.sinks())
    await sink.ensure_bucket()
    try:
        await sink.write([insight("a", 1), insight("b", 1)])
        await sink.flush()
        crafted = insight("a:1\nb", 1)  # its request id: "a:1\nb:1"
        await sink.write([crafted])
        await sink.flush()
        objects = s3_objects(isolated)
    finally:
        await sink.close()
    assert len(objects) == 2 and sum(len(v) for v in objects.values()) == 3


async def test_a_record_the_s3_sink_cannot_date_loses_none_of_the_others(isolated: Isolated) -> None:
    """A time no partition can be named for (a prompt read past its bounds, as before they were
    checked): the flush fails with every record still buffered, so the engine's commit waits. Taken out
    of the buffer first, the whole batch was gone and the retried flush, finding nothing, let the
    commit go ahead."""
    sink = S3InsightSink(isolated.sinks().model_copy(update={"s3_max_records": 4}))
    await sink.ensure_bucket()
    undatable = insight("poison", 1).model_copy(update={"last_event_ts": 1e300})  # past validation
    try:
        await sink.write([insight(f"s{i}", 1) for i in range(3)] + [undatable])  # a full buffer
        assert sink.buffered == 4, "the opportunistic flush lost the batch"
        with pytest.raises(OverflowError):
            await sink.flush()
        assert sink.buffered == 4 and sink.records_written == 0
    finally:
        sink._buffer.remove(undatable)  # so that close's flush writes the rest
        await sink.close()
    assert sink.records_written == 3


async def test_s3_flushes_by_size_and_reports_age(isolated: Isolated) -> None:
    sink = S3InsightSink(isolated.sinks().model_copy(update={"s3_max_records": 5, "s3_max_age_s": 0.1}))
    await sink.ensure_bucket()
    try:
        await sink.write([insight(f"s{i}", 1) for i in range(5)])
        assert sink.buffered == 0 and sink.records_written == 5  # size triggered a flush
        await sink.write([insight("late", 1)])
        assert not sink.due()
        await asyncio.sleep(0.15)
        assert sink.due()
    finally:
        await sink.close()
    assert sink.records_written == 6  # close flushes the rest


async def test_a_signal_read_back_says_how_old_it_is(isolated: Isolated) -> None:
    """``shopper signals``' age column: from the newest event the signal reflects, and from its write."""
    settings = isolated.sinks()
    sink = RedisSignalSink(settings)
    written = time.time()
    try:
        await sink.write([insight("s-age", 1, ts=written - 30.0)])
    finally:
        await sink.close()
    [row] = await read_signals(settings.redis_url, ["s-age"], 1, prefix=settings.redis_key_prefix)
    event_age, write_age = (float(part) for part in signal_age(row, written + 10.0).split(" / "))
    assert 39.0 <= event_age <= 40.5 and 9.0 <= write_age <= 10.5


async def test_every_signal_asked_for_by_id_is_shown_whatever_the_limit(isolated: Isolated) -> None:
    """``shopper signals id1 ... id11``: ``--limit`` (10) cut ids named one by one; it bounds only the
    newest shown when no id is given."""
    settings = isolated.sinks()
    sink = RedisSignalSink(settings)
    ids = [f"s-named-{i:02d}" for i in range(12)]
    try:
        await sink.write([insight(sid, 1) for sid in ids])
    finally:
        await sink.close()
    rows = await read_signals(settings.redis_url, ids, 10, prefix=settings.redis_key_prefix)
    assert sorted(r["shopper_id"] for r in rows) == ids


async def test_the_most_recent_signals_are_the_last_written(isolated: Isolated) -> None:
    """``shopper signals`` with no ids: ranked by ``seq``, an old session's 7th answer came before a
    shopper answered a moment ago in a session of its own (``seq`` 1)."""
    settings = isolated.sinks()
    sink = RedisSignalSink(settings)
    try:
        await sink.write([insight("s-stale", 7)])
        await asyncio.sleep(0.01)
        await sink.write([insight("s-fresh", 1)])
    finally:
        await sink.close()
    rows = await read_signals(settings.redis_url, [], 2, prefix=settings.redis_key_prefix)
    assert [r["shopper_id"] for r in rows] == ["s-fresh", "s-stale"]


async def test_the_most_recent_signals_are_found_among_many_batches_of_keys(isolated: Isolated) -> None:
    """With no ids and more signals than one pipelined read (``READ_BATCH``), only the best ``limit`` are
    kept from batch to batch: the last two written, newest first, wherever the scan meets them."""
    settings = isolated.sinks()
    sink = RedisSignalSink(settings)
    try:
        await sink.write([insight(f"s-old-{i:04d}", 1) for i in range(READ_BATCH * 2 + 7)])
        for sid in ("s-second", "s-first"):
            await asyncio.sleep(0.01)
            await sink.write([insight(sid, 2)])
    finally:
        await sink.close()
    rows = await read_signals(settings.redis_url, [], 2, prefix=settings.redis_key_prefix)
    assert [r["shopper_id"] for r in rows] == ["s-first", "s-second"]
    three = await read_signals(settings.redis_url, [], 3, prefix=settings.redis_key_prefix)
    assert [r["shopper_id"] for r in three][:2] == ["s-first", "s-second"]
    assert three[2]["shopper_id"].startswith("s-old-")


@asynccontextmanager
async def s3_denying_a_prefix(endpoint: str, denied: str) -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """The S3 endpoint behind a proxy that answers a PUT under a key holding ``denied`` with S3's
    ``403 AccessDenied`` while ``state["deny"]`` (a bucket policy denying one prefix, lifted later);
    everything else passes through unchanged."""
    async with s3_denying(endpoint, lambda r: r.method == "PUT" and denied in r.path) as proxied:
        yield proxied


@asynccontextmanager
async def s3_denying(
    endpoint: str, refused: Callable[[web.Request], bool]
) -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """The S3 endpoint behind a proxy that answers the requests ``refused`` names with S3's ``403
    AccessDenied`` (no body to a HEAD, as S3 sends) while ``state["deny"]``; everything else passes
    through unchanged."""
    state = {"deny": True}
    denial = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"

    async def forward(request: web.Request) -> web.StreamResponse:
        if state["deny"] and refused(request):
            if request.method == "HEAD":
                return web.Response(status=403)
            return web.Response(status=403, body=denial, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with session.request(
            request.method, endpoint + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            body = await upstream.read()
            kept = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "etag")}
            if request.method == "HEAD":  # no body to count: the object's own length, as S3 says it
                kept["Content-Length"] = upstream.headers.get("Content-Length", "0")
                return web.Response(status=upstream.status, headers=kept)
            return web.Response(status=upstream.status, body=body, headers=kept)

    app = web.Application(handler_args={"auto_decompress": False})  # bodies pass as they were sent
    app.router.add_route("*", "/{tail:.*}", forward)
    async with aiohttp.ClientSession(auto_decompress=False) as session, serving(app) as url:
        yield url, state


async def test_a_flush_that_wrote_some_partitions_gives_back_only_the_others(isolated: Isolated) -> None:
    """One partition's PUT refused, another's written: only the refused one goes back to the buffer.
    The whole batch went back, so the next flush wrote the written partition's records again with
    the records that came since, under another key: two objects held the same results."""
    settings = isolated.sinks()
    assert settings.s3_endpoint_url is not None
    async with s3_denying_a_prefix(settings.s3_endpoint_url, "/kind=error/") as (url, state):
        sink = S3InsightSink(settings.model_copy(update={"s3_endpoint_url": url}))
        await sink.ensure_bucket()
        try:
            await sink.write([insight("a", 1), error("c", 1)])
            with pytest.raises(ClientError, match="AccessDenied"):
                await sink.flush()
            assert sink.buffered == 1, "only the refused partition waits for the next flush"
            await sink.write([insight("a", 2)])
            state["deny"] = False
            await sink.flush()
        finally:
            await sink.close()
    ids = [str(row["request_id"]) for rows in s3_objects(isolated).values() for row in rows]
    assert sorted(ids) == ["a:1", "a:2", "c:1"], "each result in one object"


async def write_through(settings: SinkSettings, results: list[ShopperInsight]) -> None:
    """``results`` through a new S3 sink, as an engine runs one: opened (the bucket checked, or made),
    written, flushed and closed; any failure raised."""
    sink = S3InsightSink(settings)
    try:
        await sink.open()
        await sink.write(results)
        await sink.flush()
    finally:
        await sink.close()


async def test_a_missing_bucket_is_made_in_the_clients_region(isolated: Isolated) -> None:
    """Outside us-east-1 S3 refuses a ``CreateBucket`` that does not name the region
    (``IllegalLocationConstraintException``); the sink made every missing bucket without it, so a
    runner configured for eu-west-1 on a new bucket never opened."""
    bucket = f"{isolated.s3_prefix}-eu".lower()
    settings = isolated.sinks().model_copy(update={"s3_region": "eu-west-1", "s3_bucket": bucket})
    await write_through(settings, [insight("a", 1)])
    s3 = boto3.client("s3", **settings.s3_client_kwargs())
    try:
        assert s3.get_bucket_location(Bucket=bucket)["LocationConstraint"] == "eu-west-1"
        assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 1
    finally:
        for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])
        s3.delete_bucket(Bucket=bucket)


async def test_a_writer_that_may_not_check_or_make_the_bucket_still_opens_and_writes(
    isolated: Isolated,
) -> None:
    """A least-privilege writer role: ``PutObject`` under its prefix, but neither ``s3:ListBucket``
    (``HeadBucket`` answers 403) nor ``CreateBucket``. The sink answered any failed ``HeadBucket`` with
    a ``CreateBucket``, whose 403 failed ``open``, so the engine never started although it could write."""
    settings = isolated.sinks()
    assert settings.s3_endpoint_url is not None
    on_the_bucket = f"/{settings.s3_bucket}"

    def bucket_calls(request: web.Request) -> bool:  # HeadBucket and CreateBucket, not object calls
        return request.path.rstrip("/") == on_the_bucket

    async with s3_denying(settings.s3_endpoint_url, bucket_calls) as (url, _):
        await write_through(settings.model_copy(update={"s3_endpoint_url": url}), [insight("a", 1)])
    assert [str(row["request_id"]) for rows in s3_objects(isolated).values() for row in rows] == ["a:1"]


async def test_a_kafka_sink_whose_records_the_broker_refuses_fails_its_flush(isolated: Isolated) -> None:
    """The results topic does not exist and the producer asks the broker not to create it
    (``allow.auto.create.topics`` off): the real broker answers UNKNOWN_TOPIC_OR_PART in every record's
    delivery report. Nothing is left in the producer's queue then, so only the refused records say the
    results are not on the topic: the flush must raise ``SinkWriteFailed`` (a durable point must not
    pass them), naming the broker's reason, and keep them to send again."""
    sink = KafkaResultSink(
        f"{isolated.insights_topic}-never-created",
        {
            "bootstrap.servers": isolated.stack.kafka_bootstrap,
            "allow.auto.create.topics": False,
            "topic.metadata.propagation.max.ms": 1000,
        },
        flush_timeout_s=15,
    )
    try:
        await sink.write([insight("k1", 1), insight("k2", 1)])
        with pytest.raises(SinkWriteFailed, match=r"0 results still queued and 2 refused .*Unknown topic"):
            await sink.flush()
        assert sink.delivered == 0
        assert [key for key, _ in sink._refused] == [b"k1", b"k2"], "kept to be sent again"
        # Sent again, they are refused at once (the producer has learnt the topic is gone): the same
        # kind of failure, not the producer's KafkaException, and still kept.
        with pytest.raises(SinkWriteFailed, match=r"2 refused results could not be sent again"):
            await sink.flush()
        assert [key for key, _ in sink._refused] == [b"k1", b"k2"]
    finally:
        await sink.close()


async def test_a_closed_kafka_sink_holds_no_broker_connection(isolated: Isolated) -> None:
    """``close`` closes the producer, so its broker connections go while the sink is still held (a failed
    start's traceback holds it), and a second ``close`` is harmless. Seen from /proc: this process's
    established connections to the real broker's port."""
    bootstrap = isolated.stack.kafka_bootstrap
    before = broker_connections(bootstrap)
    sink = KafkaResultSink(isolated.insights_topic, {"bootstrap.servers": bootstrap})
    await sink.write([insight("k1", 1)])
    await sink.flush()
    assert sink.delivered == 1
    assert broker_connections(bootstrap) > before, "a producer that delivered holds a connection"
    await sink.close()
    await sink.close()
    assert broker_connections_left(bootstrap, before) <= 0


async def test_a_kafka_sink_flush_under_steady_writes_waits_only_for_what_came_before(tmp_path: Path) -> None:
    """The runner writes results while a durable point flushes (its calls land at any time). Once the
    broker's round trip is longer than the gap between two results, the producer's queue is never
    empty: a flush that waited for an empty queue (librdkafka's own ``flush``) ran out its time and
    failed the durable point, however healthy the broker. A flush waits for the records written before
    it began, and every one of those has its delivery report when it returns. A real broker 20 ms away
    (``tests.slow_link``), a result written every 2 ms."""
    with tansu_behind_slow_link(tmp_path, delay_s=0.02) as bootstrap:
        sink = KafkaResultSink("insights-slow-link", {"bootstrap.servers": bootstrap}, flush_timeout_s=3)
        delivered_keys: list[bytes] = []
        reports = sink._delivered

        def seen(error: KafkaError | None, message: Message) -> None:
            if error is None:
                delivered_keys.append(message.key() or b"")
            reports(error, message)

        sink._delivered = seen  # type: ignore[method-assign]
        written = 0
        stop = asyncio.Event()

        async def keep_writing() -> None:
            nonlocal written
            while not stop.is_set():
                written += 1
                await sink.write([insight(f"w{written}", 1)])
                await asyncio.sleep(0.002)

        try:
            await sink.write([insight("first", 1)])
            await sink.flush()  # the topic is made and the producer connected before the timed part
            writer = asyncio.create_task(keep_writing())
            try:
                for _ in range(3):
                    await asyncio.sleep(0.3)
                    before = {f"w{n}".encode() for n in range(1, written + 1)}
                    await sink.flush()
                    assert before <= set(delivered_keys), "a flush returned before an earlier record was"
                assert written > 300, "results were written all along"
            finally:
                stop.set()
                await writer
        finally:
            await sink.close()
