"""Iteration-level scheduler with continuous batching: the simulated GPU of one replica.

Each iteration (1) admits waiting requests, first come first served, while the batch has room
(``max_batch``) and the iteration's token budget (``max_num_tokens``, shared with one decode token per
running request) is not spent, (2) sleeps for the cost model's time of prefilling the admitted requests
plus one decode step of the running ones, scaled by ``time_scale * slowdown``, then (3) hands every
admitted request its first token and every running request one more token. A request is admitted alone
when its prompt exceeds the budget (chunked prefill is not modelled).

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

from serving.simulator.cost_model import CostModel
from serving.simulator.prefix_cache import BlockPrefixCache, cached_tokens_for

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """Per-iteration capacity, as trtllm's ``max_batch_size`` and ``max_num_tokens``."""

    max_batch: int
    max_num_tokens: int


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
    tokens_done: int = 0
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
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

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
            while self._waiting or self._running:
                admitted = self._admit()
                decoding = self._running
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
        return admitted

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
        for request in [*self._waiting, *self._running]:
            if not request.done.is_set():
                request.error = reason
                request.done.set()
                request.progress.set()
        self._waiting.clear()
        self._running = []
