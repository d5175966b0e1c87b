"""A sizing model for the near-real-time path: what an event rate needs, from measured per-unit costs.

    .venv/bin/python -m bench.sizing                       # the tables in docs/sizing.md
    .venv/bin/python -m bench.sizing --rates 50000 --prompts-per-event 0.1 --gpu-requests-per-s 4

Every input is a named, overridable number with its source in docs/sizing.md; ``check`` recomputes the
one measured point the model is checked against (the runner bench's paced row).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from bench.common import print_table


@dataclass(frozen=True)
class Inputs:
    prompts_per_event: float = 0.25
    """Synthetic trace with the default triggers (cart/purchase at once, 20 s browse pause, one prompt
    per 10 s per shopper): 1,252 prompts from 5,000 events; the runner bench: 600 from 2,400."""
    event_bytes: int = 340
    """Mean event JSON (synthetic trace)."""
    prompt_tokens: int = 3000
    answer_tokens: int = 200
    events_per_s_per_runner_process: float = 16_000
    """Runner ingest, median of three, one process (docs/benchmarks.md, 'Ingest as a ratio')."""
    events_per_s_per_flink_slot: float = 8_000
    """Assumed half a runner process: the job measured 0.46-0.54 of the runner's rate on one slot."""
    headroom: float = 0.5
    """Run stream processors at most this busy (replays and rebalances need the rest)."""
    events_per_s_per_partition: float = 4_000
    """A partition per consumer's share, four per process: rebalances move small pieces."""
    gpu_requests_per_s: float = 2.9
    """Requests/s per H100 (32B) at p99 TTFT <= 1 s and ITL <= 150 ms on the shopper workload with
    ~200-token answers: the best setup's searched goodput per GPU on the simulator's faithful defaults
    (docs/disaggregation.md, "Goodput on the faithful defaults, searched")."""
    redis_signal_bytes: int = 2_200
    """MEMORY USAGE of one shopper's signal hash."""
    redis_bytes_per_session_entry: int = 450
    session_entries_per_shopper: int = 40
    active_shoppers_per_event_per_s: float = 600
    """Shoppers whose session is live for each event/s: a session lives ~30 min and a shopper sends
    ~3 events a minute, so 1 event/s means ~600 live sessions (state TTL keeps them a week in Redis)."""
    s3_max_records: int = 5_000
    s3_max_age_s: float = 5.0
    answer_ledger_bytes: int = 1_112
    """MEMORY USAGE of one answer ledger entry (an insight's JSON, ~940 B, under its key)."""
    answer_ttl_s: float = 3_600
    """How long the ledger keeps an answer (``SinkSettings.answer_ttl_s``)."""


@dataclass(frozen=True)
class Sizing:
    events_per_s: float
    prompts_per_s: float
    gpus: int
    runner_processes: int
    flink_slots: int
    partitions: int
    redis_writes_per_s: float
    redis_gib: float
    s3_objects_per_hour: float
    kafka_mb_per_s: float


def size(events_per_s: float, i: Inputs) -> Sizing:
    prompts = events_per_s * i.prompts_per_event
    runners = math.ceil(events_per_s / (i.events_per_s_per_runner_process * i.headroom))
    slots = math.ceil(events_per_s / (i.events_per_s_per_flink_slot * i.headroom))
    writers = max(runners, slots)
    # Per writer an S3 object when s3_max_records are buffered or s3_max_age_s has passed.
    per_writer_rate = prompts / writers
    objects_per_s = writers * max(per_writer_rate / i.s3_max_records, 1 / i.s3_max_age_s)
    shoppers = events_per_s * i.active_shoppers_per_event_per_s
    memory = shoppers * (
        i.redis_signal_bytes + i.session_entries_per_shopper * i.redis_bytes_per_session_entry
    )
    memory += prompts * i.answer_ttl_s * i.answer_ledger_bytes  # every answer, for its TTL
    return Sizing(
        events_per_s=events_per_s,
        prompts_per_s=prompts,
        gpus=math.ceil(prompts / i.gpu_requests_per_s),
        runner_processes=runners,
        flink_slots=slots,
        partitions=max(math.ceil(events_per_s / i.events_per_s_per_partition), 4 * writers),
        # a signal and a ledger entry per result; session deltas are one script call per commit per
        # process, carrying every touched shopper: count the shoppers (the work Redis does), not the calls
        redis_writes_per_s=2 * prompts + events_per_s,
        redis_gib=memory / 2**30,
        s3_objects_per_hour=objects_per_s * 3600,
        kafka_mb_per_s=events_per_s * i.event_bytes / 1e6,
    )


def check(i: Inputs) -> list[str]:
    """The runner bench's paced row (docs/benchmarks.md): 2,400 events at 40/s gave 600 prompts on 3
    simulated H100 replicas, p50 freshness 4.8 s. The model's prompt rate and the replicas' load."""
    events_per_s, replicas, measured_prompts = 40.0, 3, 600
    predicted = 2400 * i.prompts_per_event
    load = events_per_s * i.prompts_per_event / (replicas * i.gpu_requests_per_s)
    return [
        f"prompts: predicted {predicted:.0f}, measured {measured_prompts}",
        f"replicas at 40 events/s: {load:.2f}x the rate they serve within a 1 s p99 TTFT; measured: "
        "answered, with p50 freshness 4.8 s (not within a 1 s TTFT, as the model says)",
        f"replicas at 300 events/s: {300 * i.prompts_per_event / (replicas * i.gpu_requests_per_s):.1f}x; "
        "measured: overloaded (p50 freshness 21 s)",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sizing", description=__doc__)
    parser.add_argument("--rates", default="100000,1000000,10000000", help="events/s")
    for item in fields(Inputs):
        flag = "--" + item.name.replace("_", "-")
        parser.add_argument(flag, type=type(item.default), default=item.default)
    args = parser.parse_args(argv)
    inputs = Inputs(**{item.name: getattr(args, item.name) for item in fields(Inputs)})
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        s = size(rate, inputs)
        rows.append(
            [f"{rate:,.0f}", f"{s.prompts_per_s:,.0f}", f"{s.gpus:,}", f"{s.partitions:,}",
             f"{s.runner_processes:,}", f"{s.flink_slots:,}", f"{s.kafka_mb_per_s:,.0f}",
             f"{s.redis_writes_per_s:,.0f}", f"{s.redis_gib:,.0f}", f"{s.s3_objects_per_hour:,.0f}"]
        )  # fmt: skip
    print_table(
        ["events/s", "LLM calls/s", "H100s (32B)", "partitions", "runner procs", "Flink slots",
         "Kafka MB/s in", "Redis writes/s", "Redis GiB", "S3 objects/h"],
        rows,
    )  # fmt: skip
    for line in check(inputs):
        print(line)


if __name__ == "__main__":
    main()
