"""Per-request timelines for ``GET /perf_metrics``, shaped like trtllm-serve's.

trtllm-serve (with ``perf_metrics_max_requests`` > 0) keeps each finished request's
``RequestPerfMetrics`` in a bounded deque and hands them out, and empties it, on ``GET /perf_metrics``:
``{"request_id", "ctx_request_id", "perf_metrics": {"first_iter", "last_iter", "timing_metrics":
{"arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"[, "kv_cache_size",
"kv_cache_transfer_start", "kv_cache_transfer_end"]}, "kv_cache_metrics": {...}}}``. The simulator writes
the same shape, its times in *simulated* seconds since the replica started (trtllm's are steady-clock
seconds; ``kv_cache_size`` is the bytes a generation replica received), and adds a ``simulator`` object
of durations in simulated ms that say where a request's time went:

- ``queue_ms``: arrival to admission (a batch slot and, with pinned blocks, room for its KV cache);
- ``prefill_ms``: the iteration that computed its prompt (everything co-batched with it included); null
  on a generation replica, which computes no prompt;
- ``kv_wait_ms``, ``transfer_ms``, ``transfer_wall_ms`` (generation replica): admission to the start of the
  pull (a receive slot), the modelled transfer time (``KvLink``), and the pull as it happened (the context
  replica's send slot and HTTP included);
- ``first_iteration_ms``: the iteration that gave this replica's first token of it (the prefill iteration,
  or a generation replica's first decode step);
- ``ttft_ms``, ``e2e_ms``: arrival here to the first / last token here;
- ``max_itl_ms``: the largest gap between consecutive tokens here, from the simulated iteration times, so
  host jitter never shows in it.
"""

from __future__ import annotations

import math
from typing import Any

from serving.simulator.disagg import prompt_blocks
from serving.simulator.engine import GenerationRequest


def perf_record(
    job: GenerationRequest, request_type: str, *, started_at: float, scale: float, block_size: int
) -> dict[str, Any]:
    """The ``/perf_metrics`` entry of a finished request; ``scale`` is wall seconds per simulated second
    (``time_scale``, or 1 at time scale 0), ``started_at`` the replica's start on the same clock."""

    def at(t: float | None) -> float | None:
        return None if t is None else round((t - started_at) / scale, 6)

    def span_ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round(1000.0 * (end - start) / scale, 3)

    total_blocks = prompt_blocks(job.prompt_tokens, block_size)
    reused = job.held_blocks if job.kv_transfer else math.ceil(job.cached_tokens / block_size)
    timing: dict[str, Any] = {
        "arrival_time": at(job.arrival),
        "first_scheduled_time": at(job.admitted_at),
        "first_token_time": at(job.first_token_at),
        "last_token_time": at(job.finished_at),
    }
    if job.kv_transfer:
        timing.update(
            {
                "kv_cache_size": job.transferred_bytes,
                "kv_cache_transfer_start": at(job.transfer_started_at),
                "kv_cache_transfer_end": at(job.transfer_ended_at),
            }
        )
    return {
        "request_id": job.request_id,
        "ctx_request_id": job.ctx_request_id,
        "request_type": request_type,
        "perf_metrics": {
            "first_iter": job.first_iter,
            "last_iter": job.last_iter,
            "timing_metrics": timing,
            "kv_cache_metrics": {
                "num_total_allocated_blocks": total_blocks,
                "num_new_allocated_blocks": total_blocks - reused,
                "num_reused_blocks": reused,
                "num_missed_blocks": total_blocks - reused,
            },
        },
        "simulator": {
            "prompt_tokens": job.prompt_tokens,
            "cached_tokens": job.cached_tokens,
            "completion_tokens": job.tokens_done,
            "queue_ms": span_ms(job.arrival, job.admitted_at),
            "prefill_ms": None if job.kv_transfer else round(job.first_iteration_ms, 3),
            "kv_wait_ms": span_ms(job.admitted_at, job.transfer_started_at) if job.kv_transfer else None,
            "transfer_ms": round(job.transfer_ms, 3) if job.kv_transfer else None,
            "transfer_wall_ms": span_ms(job.transfer_started_at, job.transfer_ended_at),
            "transferred_blocks": job.transferred_blocks if job.kv_transfer else None,
            "first_iteration_ms": round(job.first_iteration_ms, 3),
            "ttft_ms": span_ms(job.arrival, job.first_token_at),
            "e2e_ms": span_ms(job.arrival, job.finished_at),
            "max_itl_ms": round(job.max_itl_ms, 3),
        },
    }
