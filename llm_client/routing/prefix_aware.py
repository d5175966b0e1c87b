"""KV-aware routing: send a prompt to the replica that already holds the longest part of it.

Consecutive prompts of one shopper share all but their newest lines (``prompt_assembly.prompt`` keeps
them prefix-stable), so the replica that answered the previous prompt can skip most of the prefill.
This policy keeps, per replica, an *approximate* index of the KV blocks that replica is believed to
hold, and picks the replica with the lowest estimated cost::

    cost(r) = prefill_weight * uncached_tokens(prompt, r) + load(r)
    load(r) = outstanding_prefill_tokens(r) + decode_weight * outstanding_decode_tokens(r)

How the index is kept (no call to the servers, only what the client sees):

- a prompt is cut into ``block_size``-token blocks with chained hashes
  (``prompt_assembly.tokens.chained_block_hashes``), exactly as the engines' block caches and the
  simulator do, so "the replica holds block i" means "it holds the prompt up to the end of block i";
- routing a prompt to a replica records its blocks there at once (so a second prompt of the same shopper
  that arrives before the first is answered follows it);
- each replica's index is an LRU set bounded by ``max_blocks_per_replica`` (set it to about the replica's
  KV capacity in blocks), so what a replica has evicted ages out of the index too;
- each answer's ``cached_tokens`` corrects the index: a replica that reports about nothing cached where a
  long hit was expected has restarted (its index is cleared and ``Endpoint.restarts_detected`` counted);
  a failed attempt takes back the blocks that routing recorded.

Load guards, so that caches never concentrate traffic on a few replicas:

- bounded load (Mirrokni et al.): a replica with ``load_factor`` x the mean outstanding requests or more
  (and at least ``min_load_bound``) is not a candidate, whatever its cache holds;
- when the cluster is imbalanced (the most loaded replica carries more than ``imbalance_abs_tokens``
  *and* more than ``imbalance_ratio`` x the token load of the least loaded one) the policy stops
  following caches and picks the less loaded of two replicas sampled at random (power of two choices),
  until the imbalance is gone.

Guarantees: ``choose`` is deterministic for a given key, prompt, index and loads (ties go to the key's
rendezvous order, so with empty indexes and equal loads a key always lands on the same replica and only
the keys of a leaving replica move); the only randomness is the seeded power-of-two-choices fallback.
The policy does no I/O and is used from one event loop only.
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteOutcome, RouteRequest
from llm_client.routing.session_affinity import rendezvous_order
from prompt_assembly.tokens import chained_block_hashes, token_ids

log = logging.getLogger(__name__)

_HASHES = "prefix_aware.hashes"
_EXPECTED = "prefix_aware.expected_cached"
_HIT = "prefix_aware.expected_hit"


class ReplicaBlockIndex:
    """The blocks one replica is believed to hold: an LRU set of chained block hashes.

    Inserting touches a prompt's blocks from leaf to root, so the root ends up most recently used and
    LRU eviction takes leaves first, as the engines' radix/block caches do; a lookup stops at the first
    missing block, so a block whose parent aged out is never matched.
    """

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` believed held."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        for _ in range(len(blocks) - self.capacity):
            blocks.popitem(last=False)

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class PrefixAwareStats:
    """Decision counters, for benchmarks and metrics."""

    decisions: int = 0
    cache_hits: int = 0
    """Decisions that went to a replica believed to hold more than the shared head of the prompt."""
    bounded_load_skips: int = 0
    """Decisions where the cheapest replica was over the load bound and another was taken."""
    imbalance_fallbacks: int = 0
    """Decisions made by power of two choices because the cluster was imbalanced."""
    restarts_detected: int = 0


class PrefixAwarePolicy:
    """Cache-aware, load-aware routing; every knob is a constructor keyword, so it can be set with
    ``ClientConfig.policy_options`` (whose values are numbers; integers may arrive as floats).

    Knobs:

    - ``block_size`` (32): tokens per hashed block; must equal the engine's KV block size
      (``tokens_per_block`` in TensorRT-LLM, ``--block-size`` in vLLM, the simulator's ``block_size``).
    - ``prefill_weight`` (1.0): cost of one uncached prompt token, in the same unit as ``load``
      (prompt-token equivalents). Raise it to follow caches harder, lower it to balance harder.
    - ``decode_weight`` (0.1): cost of one outstanding decode token relative to one outstanding prefill
      token in ``load``. Each in-flight request counts ``max_tokens`` decode tokens. With continuous
      batching a running request delays a newcomer's first token only by its share of one decode step
      (about 1.8 ms per request in a ~55 ms step on the H100 calibration, i.e. ~0.01 ms per decode token
      of a 200-token answer), while a queued prefill token costs ~0.12 ms: hence about 0.1. Streamed
      requests leave ``outstanding_prefill_tokens`` at their first token, so ``load`` is the prefill
      still queued plus this light decode term.
    - ``load_factor`` (1.5) and ``min_load_bound`` (2): bounded load; replicas with
      ``max(min_load_bound, ceil(load_factor * (total outstanding + 1) / replicas))`` or more requests in
      flight are skipped. 1.0 is strict balance, large values disable it; ``min_load_bound`` keeps a
      nearly idle cluster from scattering a shopper whose previous prompt is still in flight. Within
      the bound ``load`` already balances; 1.25 moved 5-10% of the shoppers off their cache for no
      measurable balance gain on the benchmark (docs/routing.md).
    - ``min_hit_fraction`` (0.3): a believed match shorter than this share of the prompt counts as no
      match. Every prompt starts with the same system prompt, which soon sits on every replica; without
      this floor the first replica to hold it would attract every new shopper.
    - ``imbalance_abs_tokens`` (32768) and ``imbalance_ratio`` (4.0): the cluster counts as imbalanced
      when the largest replica ``load`` exceeds the smallest by more than ``imbalance_abs_tokens`` and is
      more than ``imbalance_ratio`` times it; then power of two choices on ``load`` decides.
    - ``max_blocks_per_replica`` (8192): LRU bound of each replica's index; about the replica's KV
      cache capacity in blocks (the simulator's ``cache_capacity_blocks``).
    - ``restart_min_expected_tokens`` (256) and ``restart_max_cached_tokens`` (block_size): an answer
      reporting at most ``restart_max_cached_tokens`` cached where a hit (above ``min_hit_fraction``) of
      at least ``restart_min_expected_tokens`` was expected means the replica lost its cache (restart).
    - ``seed`` (0): seeds the power-of-two-choices sampler.
    """

    name: ClassVar[str] = "prefix_aware"

    def __init__(
        self,
        block_size: float = 32,
        prefill_weight: float = 1.0,
        decode_weight: float = 0.1,
        load_factor: float = 1.5,
        min_load_bound: float = 2,
        min_hit_fraction: float = 0.3,
        imbalance_abs_tokens: float = 32768,
        imbalance_ratio: float = 4.0,
        max_blocks_per_replica: float = 8192,
        restart_min_expected_tokens: float = 256,
        restart_max_cached_tokens: float | None = None,
        seed: float = 0,
    ) -> None:
        if block_size < 1 or max_blocks_per_replica < 1:
            raise ValueError("block_size and max_blocks_per_replica must be positive")
        if load_factor < 1 or min_load_bound < 1:
            raise ValueError("load_factor and min_load_bound must be >= 1")
        if not 0 <= min_hit_fraction <= 1:
            raise ValueError("min_hit_fraction must be in [0, 1]")
        if imbalance_ratio < 1:
            raise ValueError("imbalance_ratio must be >= 1")
        if prefill_weight < 0 or decode_weight < 0:
            raise ValueError("weights must be non-negative")
        self.block_size = int(block_size)
        self.prefill_weight = float(prefill_weight)
        self.decode_weight = float(decode_weight)
        self.load_factor = float(load_factor)
        self.min_load_bound = int(min_load_bound)
        self.min_hit_fraction = float(min_hit_fraction)
        self.imbalance_abs_tokens = float(imbalance_abs_tokens)
        self.imbalance_ratio = float(imbalance_ratio)
        self.max_blocks_per_replica = int(max_blocks_per_replica)
        self.restart_min_expected_tokens = int(restart_min_expected_tokens)
        self.restart_max_cached_tokens = int(
            self.block_size if restart_max_cached_tokens is None else restart_max_cached_tokens
        )
        self._rng = random.Random(int(seed))
        self._indexes: dict[str, ReplicaBlockIndex] = {}
        self.stats = PrefixAwareStats()

    # ---- what the policy believes ----------------------------------------------------------------
    def index(self, endpoint: Endpoint) -> ReplicaBlockIndex:
        index = self._indexes.get(endpoint.name)
        if index is None:
            index = self._indexes[endpoint.name] = ReplicaBlockIndex(self.max_blocks_per_replica)
        return index

    def block_hashes(self, request: RouteRequest) -> list[int]:
        """The prompt's chained block hashes, computed once per request (kept in ``request.memo``)."""
        hashes = request.memo.get(_HASHES)
        if hashes is None:
            hashes = chained_block_hashes(token_ids(request.prompt_text), self.block_size)
            request.memo[_HASHES] = hashes
        return hashes  # type: ignore[return-value]

    def cached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        """Prompt tokens ``endpoint`` is believed to hold; the last prompt token is always computed."""
        matched = self.index(endpoint).longest_prefix(self.block_hashes(request))
        return max(0, min(matched * self.block_size, request.prompt_tokens - 1))

    def load_bound(self, endpoints: Sequence[Endpoint]) -> int:
        """Requests in flight at which a replica stops being a candidate (bounded load)."""
        total = sum(e.outstanding for e in endpoints) + 1
        return max(self.min_load_bound, math.ceil(self.load_factor * total / len(endpoints)))

    def load(self, endpoint: Endpoint) -> float:
        return endpoint.outstanding_prefill_tokens + self.decode_weight * endpoint.outstanding_decode_tokens

    # ---- RoutingPolicy -----------------------------------------------------------------------------
    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        if not endpoints:
            raise ValueError("choose() needs at least one endpoint")
        ordered = rendezvous_order(request.key, endpoints)
        cached = {e.name: self.cached_tokens(request, e) for e in ordered}
        loads = {e.name: self.load(e) for e in ordered}
        # A match of less than min_hit_fraction of the prompt is the head every prompt shares (system
        # prompt): it is on every busy replica, so it must not pull cold shoppers to one replica.
        floor = self.min_hit_fraction * request.prompt_tokens
        useful = {name: (tokens if tokens >= floor else 0) for name, tokens in cached.items()}

        bound = self.load_bound(ordered)
        eligible = [e for e in ordered if e.outstanding < bound] or ordered

        def cost(e: Endpoint) -> float:
            return self.prefill_weight * (request.prompt_tokens - useful[e.name]) + loads[e.name]

        high, low = max(loads.values()), min(loads.values())
        imbalanced = high - low > self.imbalance_abs_tokens and high > self.imbalance_ratio * low
        if imbalanced and len(eligible) > 1:
            a, b = self._rng.sample(eligible, 2)
            chosen = min((a, b), key=lambda e: (loads[e.name], -useful[e.name]))
            self.stats.imbalance_fallbacks += 1
        else:
            # min() keeps the first of equal costs: the key's rendezvous order breaks ties.
            chosen = min(eligible, key=cost)
            if len(eligible) < len(ordered) and cost(min(ordered, key=cost)) < cost(chosen):
                self.stats.bounded_load_skips += 1

        self.stats.decisions += 1
        if useful[chosen.name] > 0:
            self.stats.cache_hits += 1
        expected: dict[str, int] = request.memo.setdefault(_EXPECTED, {})  # type: ignore[assignment]
        expected[chosen.name] = cached[chosen.name]
        hits: dict[str, bool] = request.memo.setdefault(_HIT, {})  # type: ignore[assignment]
        hits[chosen.name] = useful[chosen.name] > 0
        self.index(chosen).insert(self.block_hashes(request))
        return chosen

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        expected = request.memo.get(_EXPECTED)
        if isinstance(expected, dict) and endpoint.name in expected:
            return request.prompt_tokens - int(expected[endpoint.name])
        return request.prompt_tokens - self.cached_tokens(request, endpoint)

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
        expected_map = request.memo.get(_EXPECTED)
        expected = int(expected_map.get(endpoint.name, 0)) if isinstance(expected_map, dict) else 0
        hashes = self.block_hashes(request)
        if not outcome.ok:
            if not outcome.connection_failed:
                # The replica did not compute this prompt: take back what routing recorded beyond the
                # part it already held. (A connection failure ejects the replica; forget() follows.)
                self.index(endpoint).remove(hashes[expected // self.block_size :])
            return
        observed = self._observed_cached_tokens(request, outcome)
        hit_map = request.memo.get(_HIT)
        # Only a real hit can reveal a restart: a replica may legitimately lack the shared head (an
        # llama-server slot never used), which is all a new shopper's prompt expected.
        expected_hit = isinstance(hit_map, dict) and bool(hit_map.get(endpoint.name))
        if (
            expected_hit
            and expected >= self.restart_min_expected_tokens
            and observed <= self.restart_max_cached_tokens
        ):
            endpoint.restarts_detected += 1
            self.stats.restarts_detected += 1
            log.warning(
                "replica %s reported %d cached tokens where %d were expected: treating it as restarted "
                "and clearing its cache index",
                endpoint.name,
                outcome.cached_tokens,
                expected,
            )
            self.forget(endpoint)
        # Whatever it held before, the replica holds this whole prompt now; refresh its recency.
        self.index(endpoint).insert(hashes)

    def forget(self, endpoint: Endpoint) -> None:
        index = self._indexes.get(endpoint.name)
        if index is not None:
            index.clear()

    # ---- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _observed_cached_tokens(request: RouteRequest, outcome: RouteOutcome) -> int:
        """The server's cached count in the router's token units: servers count with their own
        tokenizer (llama-server), so the cached *share* of the prompt is what carries over."""
        if outcome.prompt_tokens <= 0:
            return outcome.cached_tokens
        share = min(1.0, outcome.cached_tokens / outcome.prompt_tokens)
        return round(share * request.prompt_tokens)
