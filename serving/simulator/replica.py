"""One simulated replica's state: engine, cache, metrics and fault knobs, owned by its aiohttp app.

In the disaggregated roles it also owns the KV transceiver: a context replica's ``KvSender`` (finished
prompts waiting to be pulled), a generation replica's ``KvPuller`` and the tasks that pull each request's
KV cache while the engine keeps decoding the others.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from prompt_assembly.prefix_tokens import PromptTokenizer
from serving.simulator.answers import Answer, plan_answer
from serving.simulator.bad_answers import BAD_ANSWERS, BadAnswer
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.config import SimulatorConfig
from serving.simulator.cost_model import CostModel, IterationCost, KvLink
from serving.simulator.disagg import KV_CACHE_GONE, KvCacheGone, KvTransferFailed
from serving.simulator.engine import ContinuousBatchingEngine, EngineKnobs, EngineLimits, GenerationRequest
from serving.simulator.kv_events import KvEventBuffer
from serving.simulator.kv_transfer import KvPuller, KvSender
from serving.simulator.metrics import ReplicaMetrics
from serving.simulator.perf_metrics import perf_record
from serving.simulator.prefix_cache import BlockPrefixCache
from serving.simulator.roofline import RooflineCost

_log = logging.getLogger(__name__)


def engine_limits(config: SimulatorConfig) -> EngineLimits:
    """The scheduler limits a configuration asks for (also used by benchmarks that run the engine
    in-process, so they measure the same engine as the replicas they drive)."""
    return EngineLimits(
        config.max_batch,
        config.max_num_tokens,
        chunked_prefill=config.enable_chunked_prefill,
        chunking_policy=config.context_chunking_policy,
        chunk_unit=config.block_size,
        reuse_chunk_blocks=config.chunk_block_reuse,
        pin_blocks=config.pin_running_blocks or config.role != "aggregated",
        mixed_batch_cost=config.mixed_batch_cost,
        capacity_policy=config.capacity_policy,
        defer_shared_prefixes=config.defer_shared_prefixes,
        partial_reuse=config.enable_partial_reuse,
    )


def iteration_cost(config: SimulatorConfig) -> IterationCost:
    """The cost model a configuration asks for: the fused roofline of its model, data type and GPU
    (default), or the eager-PyTorch calibration table (``--cost-model eager_pytorch``)."""
    if config.cost_model == "eager_pytorch":
        return CostModel.from_calibration(config.resolved_calibration_path(), config.calibration_model)
    kv = config.kv_memory()
    return RooflineCost.for_hardware(config.calibration_model, config.gpu, config.weight_dtype, kv.kv_dtype)


@dataclass(frozen=True, slots=True)
class FirstTokenRecord:
    """How one request's first token came about, in simulated ms: the queue, then the iteration that
    prefilled it (with whatever else was prefilled and decoded in that iteration)."""

    ttft_ms: float
    queue_ms: float
    prompt_tokens: int
    cached_tokens: int
    batch_prefill_tokens: int
    batch_running: int

    @classmethod
    def of(cls, job: GenerationRequest, scale: float) -> FirstTokenRecord:
        ttft = job.ttft or 0.0
        wait = job.queue_wait or 0.0
        return cls(
            ttft_ms=round(1000.0 * ttft / scale, 3),
            queue_ms=round(1000.0 * wait / scale, 3),
            prompt_tokens=job.prompt_tokens,
            cached_tokens=job.cached_tokens,
            batch_prefill_tokens=job.batch_prefill_tokens,
            batch_running=job.batch_running,
        )


class Replica:
    """Glue between HTTP handlers and the pure parts; one per app, so replicas in one process never
    share state."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.calibration_path = config.resolved_calibration_path()
        self.cost = iteration_cost(config)
        self.kv_events = (
            KvEventBuffer(
                config.kv_event_buffer_max_size,
                # the attention window: one full-attention window of max_seq_len (trtllm's default
                # max_attention_window), not the cache's capacity
                window_size=config.max_seq_len,
                capacity_blocks=config.cache_capacity_blocks,
            )
            if config.kv_event_buffer_max_size > 0
            else None
        )
        self.cache = BlockPrefixCache(config.cache_capacity_blocks, config.block_size, self.kv_events)
        self.prompt_tokens = PromptTokenizer(config.block_size, engine_block_hashes)
        self.knobs = EngineKnobs(time_scale=config.time_scale, slowdown=config.slowdown)
        self.engine = ContinuousBatchingEngine(
            self.cost,
            self.cache,
            engine_limits(config),
            self.knobs,
            on_transfer=self._start_transfer if config.role == "generation" else None,
            on_abort=self._count_abort,
        )
        self.kv_link = KvLink(config.kv_transfer_latency_ms, config.kv_link_gbps)
        self._kv_sender: KvSender | None = None
        self.kv_puller = KvPuller(config.kv_recv_slots) if config.role == "generation" else None
        self._transfers: set[asyncio.Task[None]] = set()
        # unique across replicas too (a front end joins a generation request to its context by it)
        self._ctx_request_ids = itertools.count(
            (zlib.crc32(config.replica_id.encode()) & 0xFFFFF) * 10**6 + 1
        )
        self.started_at = time.monotonic()  # the event loop's clock (asyncio's loop.time())
        self.perf_records: deque[dict[str, Any]] = deque(maxlen=max(config.perf_metrics_max_requests, 1))
        self.metrics = ReplicaMetrics(
            config.replica_id,
            config.model_name,
            running=lambda: self.engine.num_running,
            waiting=lambda: self.engine.num_waiting,
            kv_blocks_used=lambda: self.cache.used_blocks,
        )
        self.error_rate = config.error_rate
        self.bad_answer: BadAnswer = config.bad_answer
        self.bad_answer_rate = config.bad_answer_rate
        self.recent_first_tokens: deque[FirstTokenRecord] = deque(maxlen=100_000)
        """Each finished request's first-token timeline, simulated ms (benchmarks read exact tails)."""
        self._rng = random.Random(config.seed)

    def draw_bad_answer(self) -> BadAnswer | None:
        """The bad answer this request gets, if any (seeded, like ``inject_error``)."""
        if self.bad_answer == "none" or self.bad_answer_rate <= 0:
            return None
        if self._rng.random() >= self.bad_answer_rate:
            return None
        return self._rng.choice(BAD_ANSWERS) if self.bad_answer == "mixed" else self.bad_answer

    def inject_error(self) -> bool:
        """Whether this request draws an injected 503 (seeded, so a test run is reproducible)."""
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def prepare(
        self,
        prompt_text: str,
        last_user_text: str,
        *,
        max_tokens: int | None,
        response_format: dict[str, Any] | None,
        cache_salt: str | None,
        ignore_eos: bool,
        min_tokens: int,
        streaming: bool,
    ) -> tuple[GenerationRequest, Answer]:
        """Tokenise, hash and answer a prompt: the CPU work a real server's front end does.

        A request without ``max_tokens`` is answered within ``default_max_tokens`` (the synthetic answer
        needs a length) but books ``max_seq_len - prompt`` tokens of KV memory, as TensorRT-LLM deduces
        its ``max_tokens`` (``_deduce_max_tokens`` in ``tensorrt_llm/executor/base_worker.py``)."""
        tokens = self.prompt_tokens.tokens(prompt_text, cache_salt)
        ids, hashes = tokens.ids, tokens.block_hashes
        # An answer longer than max_seq_len leaves is refused (``oversize_refusal``) before it is
        # served: planned only up to that, so a huge max_tokens or min_tokens costs no more to refuse.
        room = max(self.config.max_seq_len - len(ids), 1)
        limit = min(max_tokens or self.config.default_max_tokens, room)
        answer = plan_answer(
            prompt_text, last_user_text, limit, response_format, ignore_eos=ignore_eos, min_tokens=min_tokens
        )
        job = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_tokens=len(ids),
            block_hashes=hashes,
            completion_tokens=max(answer.completion_tokens, 1),
            streaming=streaming,
            max_new_tokens=max_tokens or max(self.config.max_seq_len - len(ids), 1),
            tokens=ids,
        )
        return job, answer

    @property
    def kv_sender(self) -> KvSender:
        """A context replica's sender; built on first use, on the event loop (it owns a semaphore)."""
        if self._kv_sender is None:
            self._kv_sender = KvSender(
                self.cache,
                self.kv_link,
                self.config.calibration_model,
                slots=self.config.kv_send_slots,
                timeout_s=self.config.kv_transfer_timeout_s,
                time_scale=lambda: self.knobs.time_scale,
                on_release=self.engine.kv_released,
            )
        return self._kv_sender

    def next_ctx_request_id(self) -> int:
        """``ctx_request_id`` of a context_only request: unique in this replica's lifetime."""
        return next(self._ctx_request_ids)

    def _count_abort(self, job: GenerationRequest) -> None:
        """A request whose client went away (``sim_request_errors_total{reason="aborted"}``)."""
        self.metrics.errors.labels("aborted").inc()

    def _start_transfer(self, job: GenerationRequest) -> None:
        """Engine callback: pull ``job``'s missing blocks off the loop, then hand it back."""
        task = asyncio.get_running_loop().create_task(self._pull(job), name=f"kv-pull-{job.request_id}")
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _pull(self, job: GenerationRequest) -> None:
        assert self.kv_puller is not None and job.kv_source is not None and job.ctx_request_id is not None
        error: str | None = None
        status = 503
        kind = "service_unavailable"
        loop = asyncio.get_running_loop()
        try:
            async with self.kv_puller.slots:
                if not job.cancelled:
                    job.transfer_started_at = loop.time()
                    missing = job.block_hashes[job.held_blocks :]
                    receipt = await self.kv_puller.pull(job.kv_source, job.ctx_request_id, missing)
                    job.transfer_ended_at = loop.time()
                    job.transferred_blocks = receipt.blocks
                    job.transferred_bytes = receipt.bytes
                    job.transfer_ms = receipt.transfer_ms
        except KvCacheGone as exc:
            error, status, kind = str(exc), 409, KV_CACHE_GONE
        except KvTransferFailed as exc:
            error, status, kind = str(exc), 503, KV_CACHE_GONE
        except asyncio.CancelledError:
            self.engine.transfer_done(job, "replica stopped during the KV transfer")
            raise
        except Exception as exc:  # a bug here must not leave the request waiting forever
            _log.exception("KV pull failed")
            error = f"KV pull failed: {exc!r}"
        self.engine.transfer_done(job, error, error_status=status, error_type=kind)

    def record_finished(self, job: GenerationRequest, request_type: str = "context_and_generation") -> None:
        m = self.metrics
        m.prompt_tokens.inc(job.prompt_tokens)
        m.cached_tokens.inc(job.cached_tokens)
        m.completion_tokens.inc(job.tokens_done)
        scale = self.knobs.time_scale or 1.0
        if job.ttft is not None:
            m.ttft.observe(job.ttft / scale)
            self.recent_first_tokens.append(FirstTokenRecord.of(job, scale))
        if job.queue_wait is not None:
            m.queue_time.observe(job.queue_wait / scale)
        if job.finished_at is not None:
            m.e2e.observe((job.finished_at - job.arrival) / scale)
        if self.config.perf_metrics_max_requests > 0:
            self.perf_records.append(
                perf_record(
                    job,
                    request_type,
                    started_at=self.started_at,
                    scale=scale,
                    block_size=self.config.block_size,
                )
            )

    def drain_perf_metrics(self) -> list[dict[str, Any]]:
        """Every kept request timeline, oldest first; emptied, as trtllm-serve's ``/perf_metrics`` is."""
        out = list(self.perf_records)
        self.perf_records.clear()
        return out

    def reset_cache(self) -> None:
        """Lose every reusable KV block, as a restarted replica would; blocks that requests in flight
        (or prompts waiting to be pulled) hold stay theirs (``BlockPrefixCache.clear``)."""
        self.cache.clear()

    def drain_first_tokens(self) -> list[FirstTokenRecord]:
        """The first-token timelines recorded since the last call (``GET /admin/ttft``), oldest first."""
        out = list(self.recent_first_tokens)
        self.recent_first_tokens.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "replica_id": self.config.replica_id,
            "model": self.config.model_name,
            "calibration_model": self.config.calibration_model,
            "calibration_path": str(self.calibration_path),
            "cost_model": self.config.cost_model,
            "time_scale": self.knobs.time_scale,
            "slowdown": self.knobs.slowdown,
            "error_rate": self.error_rate,
            "bad_answer": self.bad_answer,
            "running": self.engine.num_running,
            "kv_blocks": {
                "capacity": self.cache.capacity_blocks,
                "pinned": self.cache.pinned_blocks,
                "reserved": self.cache.reserved_blocks,
                "used": self.cache.used_blocks,
            },
            "waiting": self.engine.num_waiting,
            "cache": asdict(self.cache.stats()),
            "kv_events": None
            if self.kv_events is None
            else {"last_event_id": self.kv_events.last_event_id, "dropped": self.kv_events.dropped},
            "engine": asdict(self.engine.stats),
            **({"kv_transfer": self._kv_transfer_stats()} if self.config.role != "aggregated" else {}),
        }

    def _kv_transfer_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.config.role,
            "pinned_blocks": self.cache.pinned_blocks,
            "reserved_blocks": self.cache.reserved_blocks,
        }
        sender = self._kv_sender
        if sender is not None:
            out.update(pending=sender.pending, sent=sender.sent, expired=sender.expired)
        if self.kv_puller is not None:
            out.update(
                transferring=self.engine.num_transferring,
                received=self.kv_puller.received,
                gone=self.kv_puller.gone,
            )
        return out

    async def close(self, _app: web.Application | None = None) -> None:
        for task in list(self._transfers):
            task.cancel()
        await asyncio.gather(*self._transfers, return_exceptions=True)
        if self._kv_sender is not None:
            self._kv_sender.close()
        if self.kv_puller is not None:
            await self.kv_puller.close()
        await self.engine.close()


REPLICA_KEY = web.AppKey("replica", Replica)
