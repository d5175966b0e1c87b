"""Iteration-level scheduler with continuous batching: the simulated GPU of one replica.

Each iteration (1) admits waiting requests, first come first served, while the batch has room
(``max_batch``), the iteration's token budget (``max_num_tokens``, shared with one decode token per
running request) holds their **whole** prompts (TensorRT-LLM charges reused tokens too when prefill is not
chunked), and KV memory has their blocks (below); a prompt whose first uncached block another prompt
admitted in this iteration computes is skipped for one iteration (``beneficialToSkip``), (2) sleeps for
the cost model's time of the iteration (one fused pass by default, ``roofline.RooflineCost``) scaled by
``time_scale * slowdown``, then (3) hands every admitted request its first token and every running request
one more token. A prompt over the budget never reaches the engine: the HTTP layer refuses it (400).

With chunked prefill (``EngineLimits.chunked_prefill``, TensorRT-LLM's ``enable_chunked_prefill``) the
running requests' decode tokens are scheduled first and prefill *chunks* fill what is left of
``max_num_tokens``: a prompt may be split over several iterations (chunks are whole KV blocks except a
prompt's last), and it gets its first token at the end of the iteration that computes its last chunk. The
chunks go first come first served (trtllm's default ``FIRST_COME_FIRST_SERVED``: the oldest prompt takes
all it can) or, with ``equal_progress`` (trtllm's ``EQUAL_PROGRESS``), one block at a time to every
prompt in turn, so a short prompt is not held behind a long one. A chunk costs the calibrated prefill of
its tokens on the context computed before it (cached prefix plus earlier chunks). A partly prefilled
prompt's blocks become reusable at its last chunk, or after every chunk with ``reuse_chunk_blocks``.

Disaggregated serving (``serving.simulator.disagg``): a request with ``kv_transfer`` (TensorRT-LLM's
``generation_only``) is not prefilled. Admission gives it a batch slot and room for the prompt's blocks this
replica lacks, then hands it to ``on_transfer`` (the replica pulls those blocks from the context replica,
off the loop) and takes it back through ``transfer_done``; at the next iteration it joins the decode batch
with its prompt as context and the context replica's first token already counted. A request with
``keep_pinned`` (``context_only``) leaves its prompt's blocks pinned when it finishes, for the replica to
release once they have been pulled.

With ``EngineLimits.pin_blocks`` (the default; always on in the disaggregated roles) the prefix cache is
also the replica's KV memory: a request pins its prompt's blocks from admission until it finishes, so they
are never evicted under it, and books room for its partial last block and generated tokens. Under
``guaranteed_no_evict`` (TensorRT-LLM's default capacity policy) it books blocks for ``max_new_tokens`` at
admission and is admitted only when they fit beside the pinned and booked ones (first come first served: a
request that does not fit holds the ones behind it); under ``max_utilization`` it books a block at a time
as it generates, and the most recently started requests are paused (released, requeued, recomputed) when
none is left. Without pins, blocks are only an LRU of reusable prefixes. The eager table charges an
iteration that both prefills and decodes by ``EngineLimits.mixed_batch_cost``
(``cost_model.mixed_iteration_ms``).

Wall-clock deadlines are kept on an absolute schedule, so the overshoot of each ``asyncio.sleep`` does not
accumulate over a long decode; the loop catches up at most one iteration when the process was starved.
The loop runs as one task that exists only while there is work, so an idle replica costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from serving.simulator.cost_model import IterationCost, IterationWork, MixedBatchCost
from serving.simulator.prefix_cache import BlockPrefixCache, cached_tokens_for

_log = logging.getLogger(__name__)


ChunkingPolicy = Literal["first_come_first_served", "equal_progress"]
CapacityPolicy = Literal["guaranteed_no_evict", "max_utilization"]


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
    pin_blocks: bool = True
    """Running requests hold their blocks (prompt and generated tokens) and admission waits for room (KV
    memory, as in TensorRT-LLM); off: the cache is only an LRU of reusable blocks and a running request's
    blocks may be evicted under it (the simulator's earlier behaviour)."""
    mixed_batch_cost: MixedBatchCost = "additive"
    """How the eager table charges an iteration with both prefill and decode work
    (``cost_model.mixed_iteration_ms``); the roofline cost is always one fused pass."""
    capacity_policy: CapacityPolicy = "guaranteed_no_evict"
    """With ``pin_blocks``: ``guaranteed_no_evict`` (TensorRT-LLM's default) admits a request only when
    blocks for its prompt plus ``max_new_tokens`` fit, so a running request never waits for memory;
    ``max_utilization`` admits on the prompt's blocks, grows each request a block at a time, and pauses
    the most recently started requests when a block is missing (they recompute when readmitted)."""
    partial_reuse: bool = True
    """TensorRT-LLM's ``enable_partial_reuse``: the matching leading tokens of a stored partly filled
    block count as cached too (needs the requests' ``tokens``)."""
    defer_shared_prefixes: bool = True
    """TensorRT-LLM's ``beneficialToSkip``: a prompt whose first uncached block another prompt admitted
    in the same iteration will compute waits one iteration, then reuses those blocks."""


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
    tokens: Sequence[int] = ()
    """The prompt's token ids, for partial block reuse (empty: whole blocks only)."""
    max_new_tokens: int = 0
    """The request's ``max_tokens`` (0: ``completion_tokens``): what GUARANTEED_NO_EVICT books room for."""

    arrival: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    """Prompt tokens the cache served at the request's **first** admission: the client's
    ``usage.prompt_tokens_details.cached_tokens`` (and the metrics' and ``/perf_metrics``' count). A request
    paused under MAX_UTILIZATION and readmitted keeps it: its readmission finds its own released blocks,
    which are no prefix reuse its prompt brought (``reused_tokens`` has what the readmission skips)."""
    reused_tokens: int = 0
    """Prompt tokens the cache serves at the current admission (what its prefill skips): ``cached_tokens``
    at the first admission, then whatever a readmission after a pause finds (its own blocks included)."""
    prefilled_tokens: int = 0
    """Uncached prompt tokens computed so far (chunked prefill); the prefill ends at
    ``prompt_tokens - reused_tokens``."""
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
    error_status: int = 503
    error_type: str = "service_unavailable"

    first_iteration_ms: float = 0.0
    """Simulated ms of the iteration that gave this replica's first token of the request (its prefill
    iteration, or on a generation replica its first decode step), ``slowdown`` included."""
    max_itl_ms: float = 0.0
    """Largest gap between two consecutive tokens on this replica, simulated ms: each later token's
    iteration (a running request gets a token from every iteration, so that is the gap)."""
    first_iter: int | None = None
    last_iter: int | None = None

    # Disaggregated serving (see the module docstring).
    kv_transfer: bool = False
    """generation_only: the prompt's KV cache comes from ``kv_source``; no prefill here."""
    kv_source: str | None = None
    ctx_request_id: int | None = None
    keep_pinned: bool = False
    """context_only: the prompt's blocks stay pinned after it finishes, owned by the replica (``pins``)."""
    pins: list[list[int]] = field(default_factory=list)
    """Runs of block hashes this request pinned; each is unpinned once when it lets go."""
    reserved_blocks: int = 0
    gen_blocks: int = 0
    """Blocks booked beyond the prompt's full blocks: its partial last block and generated tokens."""
    paused: int = 0
    """Times MAX_UTILIZATION paused it for memory (it recomputes its prompt and tokens when readmitted)."""
    held_blocks: int = 0
    """generation_only: leading prompt blocks this replica already held at admission (not pulled)."""
    transfer_started_at: float | None = None
    transfer_ended_at: float | None = None
    transfer_ms: float = 0.0
    """Modelled time of the KV transfer (``KvLink``), simulated ms."""
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    kv_settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a ``kv_transfer`` request's KV cache has arrived or cannot (then ``error`` says why)."""

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
    paused: int = 0
    deferred: int = 0
    """Admissions ``beneficialToSkip`` held back one iteration for a prefix another prompt computes."""
    iterations: int = 0
    prefill_tokens_computed: int = 0
    cached_tokens_served: int = 0
    decode_tokens: int = 0
    busy_ms: float = 0.0


class ContinuousBatchingEngine:
    """Runs requests through simulated iterations; all methods must be called on the event loop."""

    def __init__(
        self,
        cost: IterationCost,
        cache: BlockPrefixCache,
        limits: EngineLimits,
        knobs: EngineKnobs,
        clock: Callable[[], float] | None = None,
        on_transfer: Callable[[GenerationRequest], None] | None = None,
        on_abort: Callable[[GenerationRequest], None] | None = None,
    ) -> None:
        self._cost = cost
        self._cache = cache
        self._limits = limits
        self._knobs = knobs
        self._clock = clock
        self._on_transfer = on_transfer
        self._on_abort = on_abort
        """Called once per aborted request, whichever path noticed the client leave (a poll, a failed
        write, a cancelled handler), so the replica counts every abort exactly once."""
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[GenerationRequest] = []
        self._prefilling: list[GenerationRequest] = []
        """Chunked prefill: requests in the batch whose prompt is not fully computed yet, oldest first."""
        self._transferring: set[GenerationRequest] = set()
        """Admitted ``kv_transfer`` requests whose KV cache is on its way (they hold a batch slot)."""
        self._ready: list[GenerationRequest] = []
        """``kv_transfer`` requests whose KV cache arrived: they join the next iteration's decode batch."""
        self._blocked = False
        """The last admission stopped at a request that does not fit in KV memory or in the batch slots
        transfers hold; with nothing else to run, the loop then waits for ``_released``."""
        self._released = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling) + len(self._transferring) + len(self._ready)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

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
        if self._on_abort is not None:
            self._on_abort(request)
        request.done.set()
        request.progress.set()
        request.kv_settled.set()
        self._released.set()  # a loop waiting for memory drops it from the queue
        if request in self._transferring:
            # generation_only with its KV pull in flight: the batch slot and the KV memory it booked go
            # back now, as an aggregated request's do (the blocks it already held stay cached, unpinned);
            # the pull's end (``transfer_done``) then finds it cancelled and stores nothing.
            self._transferring.discard(request)
            self._release(request)
            self.kv_released()

    def kv_released(self) -> None:
        """Pinned blocks or batch slots were given back outside the loop (a context replica's prompt was
        pulled or timed out): re-run admission."""
        self._released.set()
        if self._task is None and (self._waiting or self._ready):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def transfer_done(
        self,
        request: GenerationRequest,
        error: str | None = None,
        *,
        error_status: int = 503,
        error_type: str = "service_unavailable",
    ) -> None:
        """The KV cache of a ``kv_transfer`` request arrived (``error`` None) or cannot arrive."""
        self._transferring.discard(request)
        if request.cancelled or error is not None:
            self._release(request)
            if error is not None and not request.done.is_set():
                request.error, request.error_status, request.error_type = error, error_status, error_type
                request.done.set()
                request.progress.set()
            request.kv_settled.set()
            self.kv_released()
            return
        pin = self._limits.pin_blocks
        pinned = self._cache.insert(
            request.block_hashes, tokens=request.tokens, pin=pin, release_reserved=request.reserved_blocks
        )
        if pin:
            request.pins.append(pinned)
        request.reserved_blocks = 0
        request.kv_settled.set()
        if request.tokens_done >= request.completion_tokens:  # the context's token was the whole answer
            now = self._now()
            request.first_token_at = request.finished_at = now
            self.stats.served += 1
            self._release(request)
            request.done.set()
            request.progress.set()
            self.kv_released()
            return
        self._ready.append(request)
        self.kv_released()

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
            while self._waiting or self._running or self._prefilling or self._ready:
                self._blocked = False
                joining = self._take_ready()
                if self._limits.pin_blocks and self._limits.capacity_policy == "max_utilization":
                    joining = self._grow_or_pause(joining)
                decoding = [*self._running, *joining] if joining else self._running
                if self._limits.chunked_prefill:
                    chunks = self._schedule_chunks(len(joining))
                    ms = self._chunked_iteration_ms(chunks, decoding)
                    scheduled = bool(chunks or decoding)
                    newcomers = [request for request, _ in chunks]
                else:
                    admitted = self._admit(len(joining))
                    ms = self._iteration_ms(admitted, decoding)
                    scheduled = bool(admitted or decoding)
                    newcomers = admitted
                if not scheduled and self._blocked:
                    # Everything waiting waits for KV memory or for batch slots held by transfers.
                    self._released.clear()
                    await self._released.wait()
                    deadline = self._now()
                    continue
                self.stats.iterations += 1
                self.stats.busy_ms += ms
                step_ms = ms * self._knobs.slowdown
                delay = ms / 1000.0 * self._knobs.time_scale * self._knobs.slowdown
                now = self._now()
                if delay > 0:
                    start = deadline if now - deadline < delay else now
                    # Catching up (the loop woke late) never starts an iteration before a request in it
                    # arrived: one admitted while the loop lagged got a head start of that lag, which a
                    # small time scale turned into up to hundreds of simulated ms off its first token.
                    start = max([start, *(r.arrival for r in newcomers)])
                    deadline = start + delay
                    await asyncio.sleep(max(deadline - now, 0.0))
                else:
                    deadline = now
                    await asyncio.sleep(0)
                if self._limits.chunked_prefill:
                    admitted = self._complete_chunks(chunks)
                # Stamped at the instant the iteration was due, not when the sleep returned: a sleep's
                # overshoot (about a millisecond of wall time) is not the model's, and divided by a
                # small time scale it would add tens of simulated milliseconds to every first token.
                self._complete_iteration(admitted, decoding, deadline, step_ms)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave HTTP handlers waiting forever
            _log.exception("simulated engine loop failed")
            self._fail_all(f"engine failure: {exc!r}")
        finally:
            self._task = None

    def _take_ready(self) -> list[GenerationRequest]:
        """Transferred requests joining this iteration's decode batch (each decodes one token in it)."""
        if not self._ready:
            return []
        ready, self._ready = self._ready, []
        joining: list[GenerationRequest] = []
        for request in ready:
            if request.cancelled:
                self._release(request)
            else:
                joining.append(request)
        return joining

    def _admit(self, joining: int = 0) -> list[GenerationRequest]:
        """This iteration's new prompts, first come first served, while the batch has slots and the
        iteration's ``max_num_tokens`` (less one token per running request) holds their **whole**
        prompts (TensorRT-LLM charges a prompt's reused tokens too when prefill is not chunked)."""
        admitted: list[GenerationRequest] = []
        running = len(self._running) + joining
        slots = self._limits.max_batch - running - len(self._transferring)
        budget = self._limits.max_num_tokens - running
        charged = new_total = 0
        contributed: set[int] = set()
        deferred: list[GenerationRequest] = []
        now = self._now()
        while self._waiting and len(admitted) < slots:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                continue
            if request.kv_transfer:
                if not self._start_transfer(request, now):
                    break
                slots -= 1  # it holds a batch slot while its KV cache is on the way
                continue
            matched = self._cache.longest_prefix(request.block_hashes)
            if self._defer(request, matched, contributed):
                deferred.append(self._waiting.popleft())
                continue
            cached = self._cached_tokens(request, matched)
            tokens = request.prompt_tokens + self._resumed_tokens(request)
            if admitted and charged + tokens > budget:
                break
            if not self._hold_prompt(request, matched):
                break
            self._waiting.popleft()
            self._cache.match(request.block_hashes)
            request.reused_tokens = cached
            if request.admitted_at is None:
                request.admitted_at = now
                request.cached_tokens = cached
            charged += tokens
            new_total += tokens - cached
            admitted.append(request)
        self._waiting.extendleft(reversed(deferred))
        if self._waiting and len(admitted) >= slots and self._transferring:
            self._blocked = True
        for request in admitted:
            request.batch_prefill_tokens = new_total
            request.batch_running = running  # the batch this iteration decodes
        return admitted

    def _defer(self, request: GenerationRequest, matched: int, contributed: set[int]) -> bool:
        """``beneficialToSkip``: whether a prompt admitted earlier in this iteration computes this one's
        first uncached block (then it waits an iteration and reuses it). Otherwise its first uncached
        block joins ``contributed``."""
        if not self._limits.defer_shared_prefixes or matched >= len(request.block_hashes):
            return False
        first_new = request.block_hashes[matched]
        if first_new in contributed:
            self.stats.deferred += 1
            return True
        contributed.add(first_new)
        return False

    def _cached_tokens(self, request: GenerationRequest, matched: int) -> int:
        """Prompt tokens the cache serves: ``matched`` whole blocks, plus with partial reuse the leading
        tokens of the next block that a stored partial block holds; never the prompt's last token."""
        size = self._cache.block_size
        cached = cached_tokens_for(matched, size, request.prompt_tokens)
        if self._limits.partial_reuse and request.tokens:
            partial = self._cache.partial_match(request.block_hashes, matched, request.tokens)
            cached = max(0, min(matched * size + partial, request.prompt_tokens - 1))
        return cached

    @staticmethod
    def _resumed_tokens(request: GenerationRequest) -> int:
        """Tokens a paused request generated before it was paused: recomputed with its prompt."""
        return request.tokens_done if request.paused and not request.kv_transfer else 0

    def _extra_blocks(self, request: GenerationRequest, tokens_after: int) -> int:
        """Blocks beyond the prompt's full blocks a sequence of ``prompt + tokens_after`` tokens needs."""
        size = self._cache.block_size
        total = -(-(request.prompt_tokens + tokens_after) // size)
        return max(total - len(request.block_hashes), 0)

    def _hold_prompt(self, request: GenerationRequest, matched: int | None = None) -> bool:
        """With pinned blocks: pin the matched prefix and book room for the rest of the prompt and, under
        GUARANTEED_NO_EVICT, for every token it may generate (``max_new_tokens``), if it all fits beside
        what running requests hold; unpinned cached blocks count as free (eviction takes them)."""
        if not self._limits.pin_blocks:
            return True
        if matched is None:
            matched = self._cache.longest_prefix(request.block_hashes)
        if self._limits.capacity_policy == "guaranteed_no_evict":
            limit = request.max_new_tokens or request.completion_tokens
            extra = self._extra_blocks(request, max(limit, request.tokens_done + 1))
        else:
            extra = self._extra_blocks(request, request.tokens_done + 1)
        need = self._cache.blocks_to_hold(request.block_hashes) + extra
        if not self._cache.can_hold(need):
            self._blocked = True
            return False
        request.pins.append(self._cache.pin(request.block_hashes[:matched]))
        request.reserved_blocks = self._cache.blocks_to_hold(request.block_hashes)
        request.gen_blocks = extra
        self._cache.reserve(request.reserved_blocks + extra)
        return True

    def _grow_or_pause(self, joining: list[GenerationRequest]) -> list[GenerationRequest]:
        """MAX_UTILIZATION: give every decoding request the block its next token needs; when memory has
        none, pause the most recently started requests (back to the front of the queue, their blocks
        released to the cache) until the others fit. Returns ``joining`` less any paused."""
        order = [*self._running, *joining]
        paused: set[int] = set()
        for i, request in enumerate(order):
            if id(request) in paused:
                break
            need = self._extra_blocks(request, request.tokens_done + 1) - request.gen_blocks
            if request.cancelled or need <= 0:
                continue
            last = len(order) - 1
            while not self._cache.can_hold(need) and last > i:
                victim = order[last]
                if id(victim) not in paused and not victim.kv_transfer:
                    paused.add(id(victim))
                    self._pause(victim)
                last -= 1
            self._cache.reserve(need)
            request.gen_blocks += need
        if not paused:
            return joining
        self._running = [r for r in self._running if id(r) not in paused]
        return [r for r in joining if id(r) not in paused]

    def _pause(self, request: GenerationRequest) -> None:
        """Back to the front of the queue, its blocks released (still cached for its own readmission)."""
        request.paused += 1
        request.prefilled_tokens = 0
        self.stats.paused += 1
        self._release(request)
        self._waiting.appendleft(request)

    def _start_transfer(self, request: GenerationRequest, now: float) -> bool:
        """Admit a ``kv_transfer`` request: pin what this replica holds of its prompt, book room for the
        rest, and hand it to ``on_transfer``. False when its blocks do not fit yet."""
        if self._on_transfer is None:
            raise RuntimeError("a kv_transfer request reached an engine without on_transfer")
        matched = self._cache.longest_prefix(request.block_hashes)
        if not self._hold_prompt(request, matched):
            return False
        self._waiting.popleft()
        request.held_blocks = self._cache.match(request.block_hashes)
        request.cached_tokens = request.reused_tokens = cached_tokens_for(
            request.held_blocks, self._cache.block_size, request.prompt_tokens
        )
        request.admitted_at = now
        self._transferring.add(request)
        self._on_transfer(request)
        return True

    def _schedule_chunks(self, joining: int = 0) -> list[tuple[GenerationRequest, int]]:
        """This iteration's prefill chunks: decode tokens first, then chunks in the budget left."""
        running = len(self._running) + joining
        budget = self._limits.max_num_tokens - running
        unit = max(1, self._limits.chunk_unit)
        equal = self._limits.chunking_policy == "equal_progress"
        prefilling = self._drop_cancelled(self._prefilling)
        # Admit waiting requests while the batch has room and the budget can give each one a chunk
        # (first come first served: only while the budget is not already promised to older prompts).
        promised = unit * len(prefilling) if equal else sum(self._remaining(r) for r in prefilling)
        # Blocks the prompts already prefilling compute next: a prompt needing one of them waits.
        size = self._cache.block_size
        contributed = {
            r.block_hashes[(r.reused_tokens + r.prefilled_tokens) // size]
            for r in prefilling
            if (r.reused_tokens + r.prefilled_tokens) // size < len(r.block_hashes)
        }
        deferred: list[GenerationRequest] = []
        now = self._now()
        while self._waiting and running + len(prefilling) + len(self._transferring) < self._limits.max_batch:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                continue
            if request.kv_transfer:
                if not self._start_transfer(request, now):
                    break
                continue
            if budget - promised < (unit if equal else min(unit, self._peek_remaining(request))):
                break
            if self._defer(request, self._cache.longest_prefix(request.block_hashes), contributed):
                deferred.append(self._waiting.popleft())
                continue
            if not self._hold_prompt(request):
                break
            self._waiting.popleft()
            matched = self._cache.match(request.block_hashes)
            request.reused_tokens = self._cached_tokens(request, matched)
            if request.admitted_at is None:
                request.admitted_at = now
                request.cached_tokens = request.reused_tokens
            self.stats.cached_tokens_served += request.reused_tokens
            prefilling.append(request)
            promised += unit if equal else self._remaining(request)
        self._waiting.extendleft(reversed(deferred))
        if self._waiting and self._transferring:
            self._blocked = True  # possibly waiting for the slots transfers hold
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
        return request.prompt_tokens - self._cached_tokens(request, matched)

    @staticmethod
    def _remaining(request: GenerationRequest) -> int:
        return request.prompt_tokens - request.reused_tokens - request.prefilled_tokens

    def _chunked_iteration_ms(
        self, chunks: list[tuple[GenerationRequest, int]], decoding: list[GenerationRequest]
    ) -> float:
        prefills = tuple((n, r.reused_tokens + r.prefilled_tokens) for r, n in chunks)
        self.stats.prefill_tokens_computed += sum(n for _, n in chunks)
        return self._price(prefills, decoding)

    def _price(self, prefills: tuple[tuple[int, int], ...], decoding: list[GenerationRequest]) -> float:
        context = sum(r.prompt_tokens + r.tokens_done for r in decoding)
        work = IterationWork(prefills, len(decoding), context)
        return self._cost.iteration_ms(work, self._limits.mixed_batch_cost)

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
                self._store_chunk_blocks(request)
        self._prefilling = self._drop_cancelled(r for r in self._prefilling if r not in finished)
        return finished

    def _store_chunk_blocks(self, request: GenerationRequest) -> None:
        """``reuse_chunk_blocks``: the full blocks a partly prefilled prompt has computed become reusable
        now. With pins they are pinned, and the room booked for them at admission is handed back as they
        are stored: a block the cache did not hold moves from booked to pinned, never counted as both
        (counted twice, a chunked prompt looked larger than it is until its last chunk, evicting others'
        blocks and holding back admissions)."""
        done = (request.reused_tokens + request.prefilled_tokens) // self._cache.block_size
        blocks = request.block_hashes[:done]
        pin = self._limits.pin_blocks
        stored = min(self._cache.missing(blocks), request.reserved_blocks) if pin else 0
        pinned = self._cache.insert(blocks, tokens=request.tokens, pin=pin, release_reserved=stored)
        request.reserved_blocks -= stored
        if pinned:
            request.pins.append(pinned)

    def _iteration_ms(self, admitted: list[GenerationRequest], decoding: list[GenerationRequest]) -> float:
        prefills = tuple(
            (r.prompt_tokens + self._resumed_tokens(r) - r.reused_tokens, r.reused_tokens) for r in admitted
        )
        self.stats.prefill_tokens_computed += sum(n for n, _ in prefills)
        self.stats.cached_tokens_served += sum(c for _, c in prefills)
        return self._price(prefills, decoding)

    def _complete_iteration(
        self,
        admitted: list[GenerationRequest],
        decoding: list[GenerationRequest],
        now: float,
        step_ms: float = 0.0,
    ) -> None:
        iteration = self.stats.iterations
        still_running: list[GenerationRequest] = []
        for request in decoding:
            if request.cancelled:
                self._release(request)
                continue
            self.stats.decode_tokens += 1
            if request.first_token_at is None:  # a transferred request's first step here
                request.first_token_at = now
                request.first_iteration_ms = step_ms
                request.first_iter = iteration
            else:
                request.max_itl_ms = max(request.max_itl_ms, step_ms)
            if self._emit_token(request, now, iteration):
                still_running.append(request)
        pin = self._limits.pin_blocks
        for request in admitted:
            if request.cancelled:
                # The pass ran: its blocks are computed and stay reusable, only the slot is freed.
                self._cache.insert(
                    request.block_hashes, tokens=request.tokens, release_reserved=request.reserved_blocks
                )
                request.reserved_blocks = 0
                self._release(request)
                continue
            pinned = self._cache.insert(
                request.block_hashes, tokens=request.tokens, pin=pin, release_reserved=request.reserved_blocks
            )
            self._cache.store_tail(request.block_hashes, request.tokens)
            if pin:
                request.pins.append(pinned)
                request.reserved_blocks = 0
            if request.first_token_at is None:  # not a paused request resuming
                request.first_token_at = now
                request.first_iteration_ms = step_ms
                request.first_iter = iteration
            if self._emit_token(request, now, iteration):
                still_running.append(request)
        self._running = still_running

    def _emit_token(self, request: GenerationRequest, now: float, iteration: int = 0) -> bool:
        """Give ``request`` one token; return whether it still needs more."""
        request.tokens_done += 1
        request.token_times.append(now)
        request.last_iter = iteration
        if request.tokens_done >= request.completion_tokens:
            request.finished_at = now
            self.stats.served += 1
            if not request.keep_pinned:
                self._release(request)
            else:
                self._release_generated(request)
            request.done.set()
            request.progress.set()
            return False
        if request.streaming:
            request.progress.set()
        return True

    def _drop_cancelled(self, requests: Iterable[GenerationRequest]) -> list[GenerationRequest]:
        kept: list[GenerationRequest] = []
        for request in requests:
            if request.cancelled:
                self._release(request)
            else:
                kept.append(request)
        return kept

    def _release(self, request: GenerationRequest) -> None:
        """Give back what ``request`` holds of KV memory: its pins and its reservation."""
        if not request.pins and not request.reserved_blocks and not request.gen_blocks:
            return
        for run in request.pins:
            self._cache.unpin(run)
        request.pins = []
        self._cache.unreserve(request.reserved_blocks)
        request.reserved_blocks = 0
        self._release_generated(request)
        self._released.set()

    def _release_generated(self, request: GenerationRequest) -> None:
        """Give back the room booked for generated tokens (a context replica keeps only the prompt's)."""
        if request.gen_blocks:
            self._cache.unreserve(request.gen_blocks)
            request.gen_blocks = 0
            self._released.set()

    def _fail_all(self, reason: str) -> None:
        queued = [*self._waiting, *self._running, *self._prefilling, *self._transferring, *self._ready]
        for request in queued:
            self._release(request)
            if not request.done.is_set():
                request.error = reason
                request.done.set()
                request.progress.set()
            request.kv_settled.set()
        self._waiting.clear()
        self._running = []
        self._prefilling = []
        self._transferring.clear()
        self._ready = []
