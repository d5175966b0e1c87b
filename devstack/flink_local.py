"""What ``python -m devstack.flink_local`` and the Flink tests start around the job on one
machine: simulator replicas (subprocesses), an S3 endpoint (moto server), a bounded event sample.
Redis is the one configured in ``SinkSettings.redis_url`` (a local redis-server)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from devstack.processes import free_port
from flink_jobs.flink_config import NearRealtimeSettings
from serving.simulator.launch import options_flags, simulator_replicas
from serving.simulator.trtllm_options import AGGREGATED_YAML
from sinks.keys import RedisKeys

READY_TIMEOUT_S = 30.0


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """An in-process moto S3 server on a free port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def sample_events(shoppers: int, per_shopper: int, *, seed: int = 7, malformed: int = 3) -> list[bytes]:
    """A deterministic bounded sample: browsing, cart adds and purchases, a few duplicates, a few
    malformed records (for the DLQ). Event times are in the past, spread over minutes per shopper."""
    rng = random.Random(seed)
    base = 1_750_000_000.0
    out: list[bytes] = []
    kinds = ["view", "view", "click", "search", "add_to_cart", "view", "purchase"]
    for s in range(shoppers):
        ts = base + s * 7.0
        for n in range(per_shopper):
            ts += rng.choice([2.0, 5.0, 30.0])
            kind = rng.choice(kinds)
            event: dict[str, object] = {
                "event_id": f"e-{s}-{n}",
                "shopper_id": f"shopper-{s:04d}",
                "type": kind,
                "ts": ts,
            }
            if kind == "search":
                event["query"] = rng.choice(["trail running shoes", "rain jacket", "camping stove"])
            else:
                pid = rng.randrange(50)
                event["product"] = {
                    "product_id": f"p{pid}",
                    "title": f"Product {pid}",
                    "brand": "Acme",
                    "category": "outdoor",
                    "price": float(10 + pid),
                }
            out.append(orjson.dumps(event))
    if out:
        out.insert(len(out) // 2, out[len(out) // 3])  # a duplicate delivery
    bad = [b"{not json", b'{"event_id": "x", "type": "view"}', b"\xff\xfe binary"]
    for i in range(malformed):
        out.insert((i + 1) * len(out) // (malformed + 1), bad[i % len(bad)])
    return out


def local_run(settings: NearRealtimeSettings, args: argparse.Namespace) -> int:
    """``--local``: start replicas and S3 as needed, run the bounded job, print what landed where."""
    from flink_jobs.near_realtime import run_bounded

    events = (
        [line for line in Path(args.events).read_bytes().splitlines() if line.strip()]
        if args.events
        else sample_events(args.shoppers, args.events_per_shopper)
    )
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")  # moto accepts any; the Python workers inherit them
    with contextlib.ExitStack() as stack:
        llm = settings.llm
        if args.replicas > 0:
            shipped = options_flags(AGGREGATED_YAML)  # as the stack's replicas
            urls = stack.enter_context(simulator_replicas(args.replicas, extra=shipped))
            llm = llm.model_copy(update={"endpoints": urls})
        sinks = settings.sinks
        if sinks.redis_key_prefix == "su:":  # the production namespace: keep local runs apart
            sinks = sinks.model_copy(update={"redis_key_prefix": "flink-local:"})
        if sinks.s3_endpoint_url is None:
            sinks = sinks.model_copy(update={"s3_endpoint_url": stack.enter_context(moto_s3())})
        # The whole job in one MiniCluster, its own async stage enriching: a bounded local run has no
        # Kafka for a prompts topic and no enrichment runner beside it.
        settings = settings.model_copy(update={"llm": llm, "sinks": sinks, "prompts_topic": None})
        _ensure_bucket(settings)
        print(
            f"local: {len(events)} events, replicas {settings.llm.endpoints}, S3 {sinks.s3_endpoint_url}, "
            f"Redis {sinks.redis_url} (prefix {sinks.redis_key_prefix!r})",
            flush=True,
        )
        run = run_bounded(events, settings)
        results = [orjson.loads(r) for r in run.results]
        kinds = Counter(str(r["kind"]) for r in results)
        print(
            f"done in {run.seconds:.1f} s: {len(results)} results ({kinds['insight']} insights, "
            f"{kinds['superseded']} superseded by the shopper's newer prompt, {kinds['error']} errors), "
            f"{len(run.dlq)} to the DLQ",
            flush=True,
        )
        for record in run.dlq:
            print(f"  dlq: {orjson.loads(record)['reason']}")
        for result in results:
            if result["kind"] == "error":
                print(f"  error: {result['request_id']}: {result['error_type']}: {result.get('message', '')}")
        print(f"  S3 objects: {_count_objects(settings)}; Redis signal keys: {_count_signals(settings)}")
    return 0


def _s3_client(settings: NearRealtimeSettings) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=settings.sinks.s3_endpoint_url,
        region_name=settings.sinks.s3_region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _ensure_bucket(settings: NearRealtimeSettings) -> None:
    client = _s3_client(settings)
    try:
        client.head_bucket(Bucket=settings.sinks.s3_bucket)
    except Exception:
        client.create_bucket(Bucket=settings.sinks.s3_bucket)


def _count_objects(settings: NearRealtimeSettings) -> int:
    pages = (
        _s3_client(settings)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=settings.sinks.s3_bucket, Prefix=settings.sinks.s3_prefix)
    )
    return sum(len(page.get("Contents", [])) for page in pages)


def _count_signals(settings: NearRealtimeSettings) -> int:
    client = settings.sinks.sync_redis_client()
    try:
        return sum(
            1
            for _ in client.scan_iter(
                RedisKeys(settings.sinks.redis_key_prefix).signals_pattern(), count=1000
            )
        )
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m devstack.flink_local``: the job's topology on a bounded sample in the MiniCluster."""
    parser = argparse.ArgumentParser(prog="python -m devstack.flink_local", description=main.__doc__)
    parser.add_argument("--config", help="YAML or JSON file with NearRealtimeSettings fields")
    parser.add_argument("--events", help="a JSON-lines file of events (default: a generated sample)")
    parser.add_argument("--shoppers", type=int, default=20, help="generated sample: shoppers")
    parser.add_argument("--events-per-shopper", type=int, default=12, help="generated sample: events each")
    parser.add_argument("--replicas", type=int, default=2, help="simulator replicas to start")
    args = parser.parse_args(argv)
    return local_run(NearRealtimeSettings.load(args.config), args)


if __name__ == "__main__":
    sys.exit(main())
