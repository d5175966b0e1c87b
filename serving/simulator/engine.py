"""Iteration-level scheduler with continuous batching: the simulated GPU of one replica.

Each iteration (1) admits waiting requests, first come first served, while the batch has room
(``max_batch``) and the iteration's token budget (``max_num_tokens``, shared with one decode token per
running request) is not spent, (2) sleeps for the cost model's time of prefilling the admitted requests
plus one decode step of the running ones, scaled by ``time_scale * slowdown``, then (3) hands every
admitted request its first token and every running request one more token. A request is admitted alone
when its prompt exceeds the budget.

With chunked prefill (``EngineLimits.chunked_prefill``, TensorRT-LLM's ``enable_chunked_prefill``) the
running requests' decode tokens are scheduled first and prefill *chunks* fill what is left of
``max_num_tokens``: a prompt may be split over several iterations (chunks are whole KV blocks except a
prompt's last), and it gets its first token at the end of the iteration that computes its last chunk. The
chunks go first come first served (trtllm's default ``FIRST_COME_FIRST_SERVED``: the oldest prompt takes
all it can) or, with ``equal_progress`` (trtllm's ``EQUAL_PROGRESS``), one block at a time to every
prompt in turn, so a short prompt is not held behind a long one. A chunk costs the calibrated prefill of
its tokens on the context computed before it (cached prefix plus earlier chunks). A partly prefilled
prompt's blocks become reusable at its last chunk, or after every chunk with ``reuse_chunk_blocks``.

Wall-clock deadlines are kept on an absolute schedule, so the overshoot of each ``asyncio.sleep`` does not
accumulate over a long decode; the loop catches up at most one iteration when the process was starved.
The loop runs as one task that exists only while there is work, so an idle replica costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from serving.simulator.cost_model import CostModel
from serving.simulator.prefix_cache import BlockPrefixCache, cached_tokens_for

_log = logging.getLogger(__name__)


ChunkingPolicy = Literal["first_come_first_served", "equal_progress"]


@dataclass(frozen=True)
class EngineLimits:
    """Per-iteration capacity, as trtllm's ``max_batch_size`` and ``max_num_tokens``, and how a prefill
    may be split (trtllm's ``enable_chunked_prefill`` and ``context_chunking_policy``)."""

    max_batch: int
    max_num_tokens: int
    chunked_prefill: bool = False
    chunking_policy: ChunkingPolicy = "first_come_first_served"
    chunk_unit: int = 32
    """Tokens a non-final chunk is a multiple of (the KV block size, as in trtllm)."""
    reuse_chunk_blocks: bool = False
    """Blocks of a partly prefilled prompt become reusable after each chunk (vLLM's and SGLang's prefix
    caches do this); otherwise only when its last chunk is done."""


@dataclass
class EngineKnobs:
    """Settings the admin endpoint may change while the engine runs; read at every iteration."""

    time_scale: float = 1.0
    slowdown: float = 1.0


@dataclass(eq=False)
class GenerationRequest:
    """One request's work and its timeline (wall-clock seconds of the event loop's clock)."""

    request_id: str
    prompt_tokens: int
    block_hashes: Sequence[int]
    completion_tokens: int
    streaming: bool = False

    arrival: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    """Uncached prompt tokens computed so far (chunked prefill); the prefill ends at
    ``prompt_tokens - cached_tokens``."""
    tokens_done: int = 0
    batch_prefill_tokens: int = 0
    """Uncached prompt tokens of every request prefilled in the iteration that gave this one its first
    token, its own included (what a first token waited for besides the queue). With chunked prefill:
    the tokens of that last iteration's chunks only (earlier chunks of the prompt came before it)."""
    batch_running: int = 0
    """Requests decoding in that iteration (its decode step's batch)."""
    token_times: list[float] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None
    # ``progress`` is set after every new token of a streaming request; ``done`` once, at the end.
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


@dataclass
class EngineStats:
    """Totals since start; ``busy_ms`` is simulated GPU time, before ``time_scale``."""

    served: int = 0
    aborted: int = 0
    iterations: int = 0
    prefill_tokens_computed: int = 0
    cached_tokens_served: int = 0
    decode_tokens: int = 0
    busy_ms: float = 0.0


class ContinuousBatchingEngine:
    """Runs requests through simulated iterations; all methods must be called on the event loop."""

    def __init__(
        self,
        cost: CostModel,
        cache: BlockPrefixCache,
        limits: EngineLimits,
        knobs: EngineKnobs,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._cost = cost
        self._cache = cache
        self._limits = limits
        self._knobs = knobs
        self._clock = clock
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[GenerationRequest] = []
        self._prefilling: list[GenerationRequest] = []
        """Chunked prefill: requests in the batch whose prompt is not fully computed yet, oldest first."""
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; its ``done`` event is set when it finishes, fails or is aborted."""
        request.arrival = self._now()
        self._waiting.append(request)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def abort(self, request: GenerationRequest) -> None:
        """Stop working on a request (client went away); it leaves the batch at the next iteration."""
        if request.done.is_set():
            return
        request.cancelled = True
        self.stats.aborted += 1
        request.done.set()
        request.progress.set()

    async def close(self) -> None:
        """Stop the loop and release every waiter with an error."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all("engine stopped")

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def _run(self) -> None:
        try:
            deadline = self._now()
            while self._waiting or self._running or self._prefilling:
                decoding = self._running
                if self._limits.chunked_prefill:
                    chunks = self._schedule_chunks()
                    ms = self._chunked_iteration_ms(chunks, decoding)
                else:
                    admitted = self._admit()
                    ms = self._iteration_ms(admitted, decoding)
                self.stats.iterations += 1
                self.stats.busy_ms += ms
                delay = ms / 1000.0 * self._knobs.time_scale * self._knobs.slowdown
                now = self._now()
                if delay > 0:
                    start = deadline if now - deadline < delay else now
                    deadline = start + delay
                    await asyncio.sleep(max(deadline - now, 0.0))
                else:
                    deadline = now
                    await asyncio.sleep(0)
                if self._limits.chunked_prefill:
                    admitted = self._complete_chunks(chunks)
                self._complete_iteration(admitted, decoding, self._now())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave HTTP handlers waiting forever
            _log.exception("simulated engine loop failed")
            self._fail_all(f"engine failure: {exc!r}")
        finally:
            self._task = None

    def _admit(self) -> list[GenerationRequest]:
        admitted: list[GenerationRequest] = []
        slots = self._limits.max_batch - len(self._running)
        budget = self._limits.max_num_tokens - len(self._running)
        new_total = 0
        now = self._now()
        while self._waiting and len(admitted) < slots:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                continue
            matched = self._cache.longest_prefix(request.block_hashes)
            cached = cached_tokens_for(matched, self._cache.block_size, request.prompt_tokens)
            new = request.prompt_tokens - cached
            if admitted and new_total + new > budget:
                break
            self._waiting.popleft()
            self._cache.match(request.block_hashes)
            request.cached_tokens = cached
            request.admitted_at = now
            new_total += new
            admitted.append(request)
        for request in admitted:
            request.batch_prefill_tokens = new_total
            request.batch_running = len(self._running)  # the batch this iteration decodes
        return admitted

    def _schedule_chunks(self) -> list[tuple[GenerationRequest, int]]:
        """This iteration's prefill chunks: decode tokens first, then chunks in the budget left."""
        budget = self._limits.max_num_tokens - len(self._running)
        unit = max(1, self._limits.chunk_unit)
        equal = self._limits.chunking_policy == "equal_progress"
        prefilling = [r for r in self._prefilling if not r.cancelled]
        # Admit waiting requests while the batch has room and the budget can give each one a chunk
        # (first come first served: only while the budget is not already promised to older prompts).
        promised = unit * len(prefilling) if equal else sum(self._remaining(r) for r in prefilling)
        now = self._now()
        while self._waiting and len(self._running) + len(prefilling) < self._limits.max_batch:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                continue
            if budget - promised < (unit if equal else min(unit, self._peek_remaining(request))):
                break
            self._waiting.popleft()
            matched = self._cache.match(request.block_hashes)
            request.cached_tokens = cached_tokens_for(matched, self._cache.block_size, request.prompt_tokens)
            request.admitted_at = now
            self.stats.cached_tokens_served += request.cached_tokens
            prefilling.append(request)
            promised += unit if equal else self._remaining(request)
        self._prefilling = prefilling
        sizes = [0] * len(prefilling)
        left = budget
        if equal:
            progressed = True
            while left > 0 and progressed:
                progressed = False
                for i, request in enumerate(prefilling):
                    rest = self._remaining(request) - sizes[i]
                    if rest <= 0:
                        continue
                    take = rest if rest <= min(unit, left) else (min(unit, left) // unit) * unit
                    if take <= 0:
                        continue
                    sizes[i] += take
                    left -= take
                    progressed = True
        else:
            for i, request in enumerate(prefilling):
                rest = self._remaining(request)
                take = rest if rest <= left else (left // unit) * unit
                if take <= 0:
                    break
                sizes[i] = take
                left -= take
        return [(r, n) for r, n in zip(prefilling, sizes, strict=True) if n > 0]

    def _peek_remaining(self, request: GenerationRequest) -> int:
        matched = self._cache.longest_prefix(request.block_hashes)
        cached = cached_tokens_for(matched, self._cache.block_size, request.prompt_tokens)
        return request.prompt_tokens - cached

    @staticmethod
    def _remaining(request: GenerationRequest) -> int:
        return request.prompt_tokens - request.cached_tokens - request.prefilled_tokens

    def _chunked_iteration_ms(
        self, chunks: list[tuple[GenerationRequest, int]], decoding: list[GenerationRequest]
    ) -> float:
        ms = 0.0
        if chunks:
            new = sum(n for _, n in chunks)
            context = sum(r.cached_tokens + r.prefilled_tokens for r, _ in chunks)
            ms += self._cost.prefill_ms(new, context)
            self.stats.prefill_tokens_computed += new
        if decoding:
            context = sum(r.prompt_tokens + r.tokens_done for r in decoding)
            ms += self._cost.decode_step_ms(len(decoding), context)
        return ms

    def _complete_chunks(self, chunks: list[tuple[GenerationRequest, int]]) -> list[GenerationRequest]:
        """Book the chunks; return the requests whose prefill this iteration finished."""
        finished: list[GenerationRequest] = []
        iteration_tokens = sum(n for _, n in chunks)
        for request, n in chunks:
            request.prefilled_tokens += n
            if self._remaining(request) <= 0:
                request.batch_prefill_tokens = iteration_tokens
                request.batch_running = len(self._running)
                finished.append(request)
            elif self._limits.reuse_chunk_blocks and not request.cancelled:
                done = (request.cached_tokens + request.prefilled_tokens) // self._cache.block_size
                self._cache.insert(request.block_hashes[:done])
        self._prefilling = [r for r in self._prefilling if r not in finished and not r.cancelled]
        return finished

    def _iteration_ms(self, admitted: list[GenerationRequest], decoding: list[GenerationRequest]) -> float:
        ms = 0.0
        if admitted:
            cached = sum(r.cached_tokens for r in admitted)
            new = sum(r.prompt_tokens for r in admitted) - cached
            ms += self._cost.prefill_ms(new, cached)
            self.stats.prefill_tokens_computed += new
            self.stats.cached_tokens_served += cached
        if decoding:
            context = sum(r.prompt_tokens + r.tokens_done for r in decoding)
            ms += self._cost.decode_step_ms(len(decoding), context)
        return ms

    def _complete_iteration(
        self, admitted: list[GenerationRequest], decoding: list[GenerationRequest], now: float
    ) -> None:
        still_running: list[GenerationRequest] = []
        for request in decoding:
            if request.cancelled:
                continue
            self.stats.decode_tokens += 1
            if self._emit_token(request, now):
                still_running.append(request)
        for request in admitted:
            if request.cancelled:
                continue
            self._cache.insert(request.block_hashes)
            request.first_token_at = now
            if self._emit_token(request, now):
                still_running.append(request)
        self._running = still_running

    def _emit_token(self, request: GenerationRequest, now: float) -> bool:
        """Give ``request`` one token; return whether it still needs more."""
        request.tokens_done += 1
        request.token_times.append(now)
        if request.tokens_done >= request.completion_tokens:
            request.finished_at = now
            self.stats.served += 1
            request.done.set()
            request.progress.set()
            return False
        if request.streaming:
            request.progress.set()
        return True

    def _fail_all(self, reason: str) -> None:
        for request in [*self._waiting, *self._running, *self._prefilling]:
            if not request.done.is_set():
                request.error = reason
                request.done.set()
                request.progress.set()
        self._waiting.clear()
        self._running = []
        self._prefilling = []
