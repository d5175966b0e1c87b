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
  long hit was expected has restarted (its index is cleared and the client told, ``Feedback``);
  a failed attempt takes back the blocks that routing recorded, except those another attempt still in
  flight there counts on (a newer prompt of the shopper extending it: that one computes them) or that an
  answer there has since confirmed; the last of those attempts to fail takes them back.

*Precise* mode (``kv_events="precise"``) adds what the replicas themselves report: the client polls each
replica's ``POST /kv_cache_events`` (TensorRT-LLM's KV cache events, ``llm_client.kv_events``) and the
events correct each replica's index: ``stored`` blocks are added, ``removed`` ones (evictions) dropped at
once, and ``cleared``, a ``created`` after other events, or event ids starting again (a restarted
replica) empty it. The events name blocks by the engine's hashes; the router's own are rebuilt from the
blocks' token ids (``llm_client.kv_events.EngineBlockMap``, as Dynamo's router does), and only events
of the largest attention window (``window_size``; full attention) are followed. A gap in
the event ids (a poll missed events the replica's bounded buffer dropped) cannot be repaired from the
events alone (trtllm has no snapshot call): the replica's index keeps its learned belief, as in
approximate mode, and is counted (``stats.kv_gaps``). A replica that answers 404 (events off) stays
approximate. So precise mode is never worse than approximate, and exact where approximate guesses:
after evictions under cache pressure and after restarts.

Load guards, so that caches never concentrate traffic on a few replicas:

- bounded load (Mirrokni et al.): a replica with ``load_factor`` x the mean outstanding requests or more
  (and at least ``min_load_bound``) is not a candidate, whatever its cache holds; over replicas of
  different speeds (``choose(capacity_of=...)``) the mean is weighted by each replica's capacity;
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

import itertools
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from llm_client.endpoints import Endpoint
from llm_client.kv_events import EngineBlockMap
from llm_client.routing.base import NO_FEEDBACK, Feedback, RouteOutcome, RouteRequest
from llm_client.routing.queued_prefills import QueuedPrefills
from llm_client.routing.session_affinity import rendezvous_order
from prompt_assembly.prefix_tokens import PromptTokenizer
from prompt_assembly.tokens import chained_block_hashes

log = logging.getLogger(__name__)

HASHES_MEMO = "prefix_aware.hashes"
"""Where ``block_hashes`` keeps a request's hashes in ``RouteRequest.memo`` (another route of the same
prompt may share them)."""
_HASHES = HASHES_MEMO
_EXPECTED = "prefix_aware.expected_cached"
_HIT = "prefix_aware.expected_hit"
_CONFIRMED = "prefix_aware.confirmed_cached"
"""Per replica routed to: the prompt tokens it was known (not merely believed) to hold, at routing."""
_PREFILLING = "prefix_aware.prefilling"
_IN_FLIGHT = "prefix_aware.key_inflight"
"""Replicas whose ``_key_inflight`` count this request holds, one entry per attempt."""
"""Replicas this request was routed to whose prefill has not been reported done."""
_INDEXED = "prefix_aware.indexed"
"""What the replica's index held of the prompt when it was routed (before the co-batching discount)."""
_BOOKED = "prefix_aware.booked_kv"
"""Replicas whose booked KV tokens this request holds, one entry per attempt (``kv_room_guard``)."""
_SIBLING = "prefix_aware.sibling_prefilling"
"""Replicas where another prompt of the same key was still prefilling when this one was routed, with
the cached tokens believed there at that moment."""
_CREDIT = "prefix_aware.block_credit"
"""Per replica routed to: the attempt's id in that replica's block credits, while it holds them."""


class ReplicaBlockIndex:
    """The blocks one replica is believed to hold: an LRU set of chained block hashes.

    Inserting touches a prompt's blocks from leaf to root, so the root ends up most recently used and
    LRU eviction takes leaves first, as the engines' radix/block caches do; a lookup stops at the first
    missing block, so a block whose parent aged out is never matched.

    A block is *confirmed* once the replica is known to have computed it (a first token or an answer for
    a prompt holding it, or its own KV event), and only *believed* while all that is known is that
    routing sent it there (the prompt may still be waiting in the replica's queue). Routing follows both;
    only confirmed blocks are evidence of a restart.
    """

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, bool] = OrderedDict()
        """Block hash -> confirmed."""

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

    def confirmed_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` the replica is known to have computed."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if not blocks.get(h, False):
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int], *, confirmed: bool = False) -> None:
        """Record ``hashes`` as held (``confirmed``: computed there; a confirmed block stays confirmed)."""
        blocks = self._blocks
        for h in reversed(hashes):
            known = blocks.get(h)
            if known is not None:
                blocks.move_to_end(h)
                if confirmed and not known:
                    blocks[h] = True
            else:
                blocks[h] = confirmed
        for _ in range(len(blocks) - self.capacity):
            blocks.popitem(last=False)

    def is_confirmed(self, h: int) -> bool:
        """Whether block ``h`` is held and known to have been computed there."""
        return self._blocks.get(h, False)

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()


class PrefixAwareSettings(BaseModel):
    """Every knob of ``PrefixAwarePolicy``, with the measurement behind its default (docs/routing.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["prefix_aware"] = "prefix_aware"
    block_size: int = Field(
        32, ge=1, description="tokens per hashed block; must equal the engine's KV block size "
        "(tokens_per_block in TensorRT-LLM, --block-size in vLLM, the simulator's block_size)"
    )  # fmt: skip
    remembered_prompts: int = Field(
        256, ge=1, description="recent prompts whose tokens and block hashes a request's prompt may "
        "start from (prompt_assembly.prefix_tokens; about 50 KB each for a 4k-token prompt)"
    )  # fmt: skip
    prefill_weight: float = Field(
        1.0, ge=0, description="cost of one uncached prompt token, in the unit of load (prompt-token "
        "equivalents); raise it to follow caches harder, lower it to balance harder"
    )  # fmt: skip
    decode_weight: float = Field(
        0.1, ge=0, description="cost of one in-flight decode token relative to a queued prefill token. "
        "With continuous batching a running request delays a newcomer's first token only by its share of "
        "one decode step (~1.8 ms per request in a ~55 ms step on the eager H100 table, ~0.01 ms per "
        "token of a 200-token answer) while a queued prefill token costs ~0.12 ms: hence about 0.1"
    )  # fmt: skip
    load_factor: float = Field(
        1.5, ge=1, description="bounded load: a replica with max(min_load_bound, ceil(load_factor x "
        "(in flight + 1) / replicas)) requests in flight is not a candidate; lower moves more shoppers "
        "off their cache for balance (docs/routing.md has the measurements)"
    )  # fmt: skip
    min_load_bound: int = Field(
        2, ge=1, description="the bound never drops below this (a nearly idle cluster does not scatter a "
        "shopper whose previous prompt is still in flight)"
    )  # fmt: skip
    min_hit_fraction: float = Field(
        0.3, ge=0, le=1, description="a believed match shorter than this share of the prompt counts as "
        "none: every prompt starts with the same system prompt, which soon sits on every replica"
    )  # fmt: skip
    imbalance_abs_tokens: float = Field(32768, ge=0, description="imbalance test, absolute part (load)")
    imbalance_ratio: float = Field(
        4.0, ge=1, description="imbalance test, relative part: when the largest load exceeds the smallest "
        "by imbalance_abs_tokens and is this many times it, the less loaded of two random replicas wins"
    )  # fmt: skip
    max_blocks_per_replica: int = Field(
        1848, ge=1, description="LRU bound of each replica's index: about its KV capacity in blocks, "
        "which trtllm-serve prints at start. The default is one H100 80GB serving Qwen2.5-32B in bf16 "
        "(the simulator's default replica, sized as TensorRT-LLM sizes it: serving.simulator.hardware"
        ".kv_memory); an index larger than the cache believes in blocks the replica has evicted"
    )  # fmt: skip
    restart_min_expected_tokens: int = Field(
        256, ge=0, description="a restart is only inferred where a real hit of at least this many "
        "tokens was expected ..."
    )  # fmt: skip
    restart_max_cached_tokens: int | None = Field(
        None, ge=0, description="... and at most this many came back (default: block_size)"
    )
    hot_key_spread: bool = Field(
        False, description="tail guard, off by default: once prompts no longer join a queued sibling's "
        "iteration (cobatch_window_s), spreading a hot shopper trades prefill (its prompts go cold "
        "elsewhere) for its tail; docs/routing.md has the measurements"
    )  # fmt: skip
    hot_key_share: float = Field(
        0.5, gt=0, le=1, description="with hot_key_spread: a replica already running this share of the "
        "load bound in requests "
        "of ONE shopper takes no more of that shopper's prompts while another replica can: a hot shopper "
        "spreads over a second (then third) replica instead of saturating its holder"
    )  # fmt: skip
    hot_key_min_inflight: int = Field(
        4, ge=1, description="... but never below this many of the shopper's requests on the replica"
    )
    max_queued_tokens: float = Field(
        16384, gt=0, description="admission by predicted wait: a replica whose queued prefill load exceeds "
        "this (two full 8192-token iterations) is not a candidate while another is under it, whatever "
        "it caches"
    )  # fmt: skip
    kv_room_guard: bool = Field(
        False, description="affinity that respects KV capacity: a replica whose requests in flight book "
        "more KV memory than it holds once this one is added (prompt + max_tokens each, what "
        "GUARANTEED_NO_EVICT books; capacity max_blocks_per_replica x block_size, or the replica's own "
        "created event in precise mode) would queue it for memory, so it is not a candidate while another "
        "has room, whatever it caches"
    )  # fmt: skip
    pending_min_hit_rate: float = Field(
        0.5, ge=0, le=1, description="a believed match on a replica where the same shopper's previous "
        "prompt is still being prefilled counts only while at least this share of such prompts came back "
        "warm (learned from answers; 1 at start). On an engine that prefills a prompt in one iteration "
        "the next prompt finds the blocks; with chunked prefill it usually does not, and following the "
        "belief piles a hot shopper's cold prompts on one replica"
    )  # fmt: skip
    pending_hit_alpha: float = Field(
        0.1, gt=0, le=1, description="weight of each new answer in that learned share (EWMA)"
    )
    cobatch_window_s: float = Field(
        0.05, ge=0, description="seconds a prompt routed to a replica that runs other requests counts as "
        "still queued there (not admitted into an iteration yet); one routed while a prefill ran there "
        "counts as queued until that replica sends a first token. A new prompt of the same key sent "
        "there would join its iteration and reuse only what it found cached (an engine reuses computed "
        "blocks only; both compute the rest, and every first token of that iteration waits for both), "
        "so that is all it is believed to find. About one decode iteration; longer keeps prompts from "
        "their siblings' cache for longer (docs/routing.md has the measurements); 0 = off"
    )  # fmt: skip
    interference_weight: float = Field(
        0.0, ge=0, description="a prefill delays every request that reaches its replica while it runs, "
        "and a replica that gets more of the traffic (a hot shopper's holder) has more such requests: the "
        "uncached tokens are charged (1 + this x the replica's recent share of the traffic x replicas), "
        "so a cold prompt goes where few requests follow it. 0 = off"
    )  # fmt: skip
    traffic_share_alpha: float = Field(
        1 / 32, gt=0, le=1, description="weight of each decision in a replica's recent traffic share (EWMA)"
    )
    seed: int = Field(0, description="seeds the power-of-two-choices sampler")
    kv_events: Literal["off", "precise"] = Field(
        "off", description="precise: follow the replicas' KV cache events (POST /kv_cache_events); "
        "off: approximate, learned from routing and answers only"
    )  # fmt: skip
    kv_events_poll_s: float = Field(0.25, gt=0, description="seconds between event polls of a replica")


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
    """Restarts inferred from answers (approximate mode's only way to see one)."""
    restart_checks_skipped: int = 0
    """Cold answers not taken as a restart: the key's previous prompt was still prefilling there."""
    pending_matches_ignored: int = 0
    """Decisions that ignored a believed match resting on a prompt still being prefilled (the learned
    share of such prompts that came back warm was below ``pending_min_hit_rate``)."""
    pending_hit_rate: float = 1.0
    """That learned share (EWMA over answers to prompts routed during a sibling's prefill)."""
    cobatch_avoided: int = 0
    """Decisions that discounted a believed match resting on an attempt of the same key likely still
    queued there (``cobatch_window_s``: admitted in one iteration, both would compute its part)."""
    kv_events: int = 0
    """KV cache events applied (precise mode)."""
    kv_blocks_removed: int = 0
    kv_restarts: int = 0
    """Replicas found restarted or cleared by their events (created/cleared, event ids starting over)."""
    kv_gaps: int = 0
    """Polls whose first event id skipped ids: events the replica dropped before they were read."""
    kv_blocks_unrebuilt: int = 0
    """Stored blocks whose router hash could not be rebuilt from the event (parent never seen stored,
    a partly filled block, tokens with extra ids): not indexed."""
    kv_events_other_window: int = 0
    """Events skipped because they were about a smaller attention window than the largest ``created``
    announced (a sliding-window layer group's pool)."""
    hot_key_spreads: int = 0
    """Decisions that skipped a replica because it already ran its share of this shopper's requests."""
    queue_cap_skips: int = 0
    """Decisions that skipped a replica whose queued prefill exceeded ``max_queued_tokens``."""
    kv_room_skips: int = 0
    """Decisions that skipped a replica whose booked KV memory had no room for the prompt
    (``kv_room_guard``)."""


@dataclass(slots=True)
class _BlockCredit:
    """The attempts in flight on a replica that count on one block only routing recorded there."""

    attempts: set[int] = field(default_factory=set)
    orphaned: bool = False
    """An attempt that recorded the block failed while others counted on it: it stayed for them, and
    goes when the last of them fails too."""


@dataclass(slots=True)
class _EventCursor:
    last_event_id: int | None = None
    max_window: int | None = None
    """The largest ``window_size`` of the ``created`` events since the replica (re)started."""
    seen_blocks: bool = False
    """A stored or removed event came since the (re)start: a ``created`` now means a new engine."""


class PrefixAwarePolicy:
    """Cache-aware, load-aware routing; its knobs are ``PrefixAwareSettings`` (given whole, or as
    keywords: ``PrefixAwarePolicy(load_factor=1.25)``)."""

    name: ClassVar[str] = "prefix_aware"
    settings_type: ClassVar[type[BaseModel]] = PrefixAwareSettings

    def __init__(
        self,
        settings: PrefixAwareSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        **knobs: Any,
    ) -> None:
        if settings is None or knobs:
            base = settings.model_dump() if settings is not None else {}
            settings = PrefixAwareSettings.model_validate({**base, **knobs})
        self.settings = settings
        self.block_size = settings.block_size
        self.prefill_weight = settings.prefill_weight
        self.decode_weight = settings.decode_weight
        self.load_factor = settings.load_factor
        self.min_load_bound = settings.min_load_bound
        self.min_hit_fraction = settings.min_hit_fraction
        self.imbalance_abs_tokens = settings.imbalance_abs_tokens
        self.imbalance_ratio = settings.imbalance_ratio
        self.max_blocks_per_replica = settings.max_blocks_per_replica
        self.restart_min_expected_tokens = settings.restart_min_expected_tokens
        limit = settings.restart_max_cached_tokens
        self.restart_max_cached_tokens = settings.block_size if limit is None else limit
        self._rng = random.Random(settings.seed)
        self._indexes: dict[str, ReplicaBlockIndex] = {}
        self._cursors: dict[str, _EventCursor] = {}
        self._engine_blocks: dict[str, EngineBlockMap] = {}
        """Precise mode: per replica, the engine's block hashes and the router hashes rebuilt for them."""
        self._key_inflight: dict[tuple[str, str], int] = {}
        """Attempts in flight per (shopper, replica): routed, and neither observed nor over
        (``attempt_over``, which the client calls at the end of every attempt, a cancelled one too), so
        the map holds only what is in flight, even for the gateway's one-off anonymous keys."""
        self._queued = QueuedPrefills(settings.cobatch_window_s, clock)
        """Attempts per (key, replica) whose prefill is not over (``prefill_done`` not called yet), and
        which of them are likely still queued (not admitted into an iteration): the co-batching rule."""
        self._credits: dict[str, dict[int, _BlockCredit]] = {}
        """Per replica, the blocks in its index that rest on attempts in flight only (routing recorded
        them; no answer there has confirmed them yet), and which attempts count on each: a failed attempt
        takes back only those no other attempt counts on any more (``_taken_back``)."""
        self._attempt_ids = itertools.count()
        self._booked_kv: dict[str, int] = {}
        """KV tokens the attempts in flight book on each replica (prompt + max_tokens), ``kv_room_guard``."""
        self._kv_capacity: dict[str, int] = {}
        """Replicas' KV capacity in tokens as their ``created`` events announced it (precise mode)."""
        self._traffic_share: dict[str, float] = {}
        """Each replica's recent share of the routed requests (EWMA over decisions; sums to about 1)."""
        self._prompt_tokens = PromptTokenizer(
            settings.block_size, chained_block_hashes, settings.remembered_prompts
        )
        """Each request's block hashes from the longest prefix of a recent prompt on: a shopper's prompts
        extend one another, and tokenising and hashing a 4k-token prompt from scratch took 1.5-1.8 ms
        (docs/routing.md)."""
        self.stats = PrefixAwareStats()

    @property
    def kv_event_poll_s(self) -> float | None:
        return self.settings.kv_events_poll_s if self.settings.kv_events == "precise" else None

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
            hashes = self._prompt_tokens.tokens(request.prompt_text).block_hashes
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

    def load_bounds(
        self, endpoints: Sequence[Endpoint], capacity_of: Callable[[Endpoint], float]
    ) -> dict[str, int]:
        """Bounded load over replicas of different speeds: each replica's bound is its share of the
        requests in flight by capacity (``capacity_of``, any unit), so a replica twice as fast may
        hold twice as many before its shoppers are moved off their cache."""
        total = sum(e.outstanding for e in endpoints) + 1
        capacity = {e.name: max(capacity_of(e), 1e-9) for e in endpoints}
        whole = sum(capacity.values())
        return {
            name: max(self.min_load_bound, math.ceil(self.load_factor * total * share / whole))
            for name, share in capacity.items()
        }

    def kv_capacity_tokens(self, endpoint: Endpoint) -> int:
        """The replica's KV memory in tokens: what its ``created`` event announced (precise mode), else
        ``max_blocks_per_replica`` blocks."""
        return self._kv_capacity.get(endpoint.name, self.max_blocks_per_replica * self.block_size)

    def load(self, endpoint: Endpoint) -> float:
        return endpoint.outstanding_prefill_tokens + self.decode_weight * endpoint.outstanding_decode_tokens

    # ---- RoutingPolicy -----------------------------------------------------------------------------
    def choose(
        self,
        request: RouteRequest,
        endpoints: Sequence[Endpoint],
        *,
        time_of: Callable[[Endpoint, float], float] | None = None,
        capacity_of: Callable[[Endpoint], float] | None = None,
    ) -> Endpoint:
        """``time_of(endpoint, tokens)`` turns a cost in tokens into the time it takes there, and
        ``capacity_of(endpoint)`` is the replica's relative capacity for the load bound (a policy that
        knows each replica's speed and round trip, ``predicted_ttft``); None = every replica is as fast
        as every other, and tokens are the cost."""
        if not endpoints:
            raise ValueError("choose() needs at least one endpoint")
        ordered = rendezvous_order(request.key, endpoints)
        cached = {e.name: self.cached_tokens(request, e) for e in ordered}
        loads = {e.name: self.load(e) for e in ordered}
        # A match of less than min_hit_fraction of the prompt is the head every prompt shares (system
        # prompt): it is on every busy replica, so it must not pull cold shoppers to one replica.
        floor = self.min_hit_fraction * request.prompt_tokens
        useful = {name: (tokens if tokens >= floor else 0) for name, tokens in cached.items()}
        pending = {e.name for e in ordered if self._queued.pending(request.key, e.name)}
        ignored: set[str] = set()
        if pending and self.stats.pending_hit_rate < self.settings.pending_min_hit_rate:
            # The belief there rests on a prompt the replica is still computing, and such prompts have
            # mostly come back cold: the replica holds nothing for this one yet.
            if any(useful[name] for name in pending):
                self.stats.pending_matches_ignored += 1
            for name in pending:
                useful[name] = 0
            ignored = pending
        indexed = dict(cached)
        """What each replica's index holds of the prompt, before the co-batching discount."""
        discounted = False
        for name in pending:
            found = self._queued.queued_found(request.key, name)
            if found is not None and cached[name] > found:
                # Admitted together with that attempt, this prompt reuses only what it reuses.
                cached[name] = found
                useful[name] = found if found >= floor else 0
                discounted = True
        if discounted:
            self.stats.cobatch_avoided += 1

        bound = self.load_bound(ordered)
        bounds = (
            {e.name: bound for e in ordered}
            if capacity_of is None
            else self.load_bounds(ordered, capacity_of)
        )
        eligible = [e for e in ordered if e.outstanding < bounds[e.name]] or ordered
        # Admission by predicted wait: a long prefill queue delays a first token more than a cold prefill.
        calm = [e for e in eligible if loads[e.name] <= self.settings.max_queued_tokens]
        if calm and len(calm) < len(eligible):
            self.stats.queue_cap_skips += 1
            eligible = calm
        if self.settings.kv_room_guard:
            # Affinity within capacity: a replica whose KV memory is booked full queues a new request
            # for memory (GUARANTEED_NO_EVICT), however much of its prompt it caches.
            need = request.prompt_tokens + request.max_tokens
            booked = self._booked_kv
            room = [e for e in eligible if booked.get(e.name, 0) + need <= self.kv_capacity_tokens(e)]
            if room and len(room) < len(eligible):
                self.stats.kv_room_skips += 1
                eligible = room
        if self.settings.hot_key_spread:
            # A hot shopper spreads over more replicas once it holds its share of one.
            key_cap = max(self.settings.hot_key_min_inflight, self.settings.hot_key_share * bound)
            spread = [e for e in eligible if self._key_inflight.get((request.key, e.name), 0) < key_cap]
            if spread and len(spread) < len(eligible):
                self.stats.hot_key_spreads += 1
                eligible = spread

        n = len(ordered)
        interference = self.settings.interference_weight

        def cost(e: Endpoint) -> float:
            uncached: float = request.prompt_tokens - useful[e.name]
            if interference > 0:
                uncached *= 1 + interference * n * self._traffic_share.get(e.name, 1 / n)
            tokens = self.prefill_weight * uncached + loads[e.name]
            return tokens if time_of is None else time_of(e, tokens)

        high, low = max(loads.values()), min(loads.values())
        imbalanced = high - low > self.imbalance_abs_tokens and high > self.imbalance_ratio * low
        if imbalanced and len(eligible) > 1:
            a, b = self._rng.sample(eligible, 2)
            wait = loads if time_of is None else {e.name: time_of(e, loads[e.name]) for e in (a, b)}
            chosen = min((a, b), key=lambda e: (wait[e.name], -useful[e.name]))
            self.stats.imbalance_fallbacks += 1
        else:
            # min() keeps the first of equal costs: the key's rendezvous order breaks ties.
            chosen = min(eligible, key=cost)
            if len(eligible) < len(ordered) and cost(min(ordered, key=cost)) < cost(chosen):
                self.stats.bounded_load_skips += 1

        alpha = self.settings.traffic_share_alpha
        for e in ordered:
            share = self._traffic_share.get(e.name, 1 / n)
            self._traffic_share[e.name] = share + alpha * (float(e is chosen) - share)
        self.stats.decisions += 1
        if useful[chosen.name] > 0:
            self.stats.cache_hits += 1
        recorded: dict[str, int] = request.memo.setdefault(_INDEXED, {})  # type: ignore[assignment]
        recorded[chosen.name] = indexed[chosen.name]
        hits: dict[str, bool] = request.memo.setdefault(_HIT, {})  # type: ignore[assignment]
        hits[chosen.name] = useful[chosen.name] > 0
        confirmed: dict[str, int] = request.memo.setdefault(_CONFIRMED, {})  # type: ignore[assignment]
        known = self.index(chosen).confirmed_prefix(self.block_hashes(request)) * self.block_size
        confirmed[chosen.name] = max(0, min(known, request.prompt_tokens - 1))
        # What the replica is expected to reuse (its load and predicted_ttft's learned speed count the
        # rest): where the belief was ignored, only what it is known to have computed.
        expected: dict[str, int] = request.memo.setdefault(_EXPECTED, {})  # type: ignore[assignment]
        found = cached[chosen.name]
        expected[chosen.name] = min(found, confirmed[chosen.name]) if chosen.name in ignored else found
        self._credit(request, chosen.name, indexed[chosen.name] // self.block_size)
        self.index(chosen).insert(self.block_hashes(request))
        slot = (request.key, chosen.name)
        self._key_inflight[slot] = self._key_inflight.get(slot, 0) + 1
        counted: list[str] = request.memo.setdefault(_IN_FLIGHT, [])  # type: ignore[assignment]
        counted.append(chosen.name)
        if self.settings.kv_room_guard:
            booked_on: list[str] = request.memo.setdefault(_BOOKED, [])  # type: ignore[assignment]
            booked_on.append(chosen.name)
            self._booked_kv[chosen.name] = (
                self._booked_kv.get(chosen.name, 0) + request.prompt_tokens + request.max_tokens
            )
        if chosen.name in pending:
            sibling: dict[str, int] = request.memo.setdefault(_SIBLING, {})  # type: ignore[assignment]
            sibling[chosen.name] = cached[chosen.name] if cached[chosen.name] >= floor else 0
        prefilling: set[str] = request.memo.setdefault(_PREFILLING, set())  # type: ignore[assignment]
        prefilling.add(chosen.name)
        self._queued.routed(
            request.key, chosen.name, request, found=cached[chosen.name], replica_busy=chosen.outstanding > 0
        )
        return chosen

    def prefill_done(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The replica computed ``request``'s prompt: a later prompt of the key can reuse it (idempotent;
        ``observe`` calls it too, for callers that never report the first token)."""
        self._prefill_over(request, endpoint, computed=True)

    def prefill_abandoned(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The attempt ended without a first token (idempotent, and a no-op after ``prefill_done``)."""
        self._prefill_over(request, endpoint, computed=False)

    def _prefill_over(self, request: RouteRequest, endpoint: Endpoint, *, computed: bool) -> None:
        """The attempt's prefill is done (``computed``) or will never be (it failed); once per attempt."""
        prefilling = request.memo.get(_PREFILLING)
        if not isinstance(prefilling, set) or endpoint.name not in prefilling:
            return
        prefilling.discard(endpoint.name)
        self._queued.finished(request.key, endpoint.name, request, computed=computed)
        if computed:  # the replica has computed this prompt: its blocks there are known, not believed
            self.index(endpoint).insert(self.block_hashes(request), confirmed=True)

    def attempt_over(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The attempt on ``endpoint`` ended, however (idempotent after ``observe``): it leaves the key's
        in-flight count."""
        counted = request.memo.get(_IN_FLIGHT)
        if isinstance(counted, list) and endpoint.name in counted:
            counted.remove(endpoint.name)
            _release(self._key_inflight, (request.key, endpoint.name))
        self._release_credit(request, endpoint.name)
        booked = request.memo.get(_BOOKED)
        if isinstance(booked, list) and endpoint.name in booked:
            booked.remove(endpoint.name)
            left = self._booked_kv.get(endpoint.name, 0) - request.prompt_tokens - request.max_tokens
            if left > 0:
                self._booked_kv[endpoint.name] = left
            else:
                self._booked_kv.pop(endpoint.name, None)

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        expected = request.memo.get(_EXPECTED)
        if isinstance(expected, dict) and endpoint.name in expected:
            return request.prompt_tokens - int(expected[endpoint.name])
        return request.prompt_tokens - self.cached_tokens(request, endpoint)

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> Feedback:
        if not outcome.ok and not outcome.connection_failed:
            # The replica did not compute this prompt: take back what routing recorded beyond the part
            # its index already held, but not what a sibling still in flight there counts on (it
            # computes those blocks) nor what an answer there confirmed since. (A connection failure
            # ejects the replica; forget() follows.)
            self.index(endpoint).remove(self._taken_back(request, endpoint.name))
        self._prefill_over(request, endpoint, computed=outcome.ok)
        self.attempt_over(request, endpoint)
        expected_map = request.memo.get(_EXPECTED)
        expected = int(expected_map.get(endpoint.name, 0)) if isinstance(expected_map, dict) else 0
        hashes = self.block_hashes(request)
        if not outcome.ok:
            return NO_FEEDBACK
        observed = self._observed_cached_tokens(request, outcome)
        hit_map = request.memo.get(_HIT)
        # Only a real hit can reveal a restart: a replica may legitimately lack the shared head (an
        # llama-server slot never used), which is all a new shopper's prompt expected.
        expected_hit = isinstance(hit_map, dict) and bool(hit_map.get(endpoint.name))
        # Nor can a prompt routed while the same key's previous prompt was still being prefilled there:
        # the replica had not stored those blocks yet (an engine reuses only computed blocks), so the
        # expected hit was routing's own record, not the replica's cache. With chunked prefill, or a
        # queue in a burst, that window is long, and clearing the index on it scattered every shopper
        # the replica held.
        sibling_map = request.memo.get(_SIBLING)
        sibling_pending = isinstance(sibling_map, dict) and endpoint.name in sibling_map
        if sibling_pending:
            believed = int(sibling_map[endpoint.name])  # type: ignore[index]
            if believed >= self.restart_min_expected_tokens:
                warm = observed >= 0.5 * believed
                alpha = self.settings.pending_hit_alpha
                self.stats.pending_hit_rate += alpha * (float(warm) - self.stats.pending_hit_rate)
                if not warm:
                    self.stats.restart_checks_skipped += 1
        # And only blocks the replica is known to have computed: what routing alone recorded there may
        # still be in its queue. In a burst, every prompt admitted in a replica's first iterations
        # found nothing cached, while the index already believed the head all prompts share (system
        # prompt and header: 384 tokens) because other shoppers' prompts had been routed there: under
        # 30% of a short prompt, so it counted as a hit, and a restart was inferred (12 times in
        # ``make demo``, on replicas that had not restarted).
        confirmed_map = request.memo.get(_CONFIRMED)
        known = int(confirmed_map.get(endpoint.name, 0)) if isinstance(confirmed_map, dict) else 0
        restarted = (
            expected_hit
            and not sibling_pending
            and min(expected, known) >= self.restart_min_expected_tokens
            and observed <= self.restart_max_cached_tokens
        )
        if restarted:
            self.stats.restarts_detected += 1
            log.warning(
                "replica %s reported %d cached tokens where %d were expected: treating it as restarted "
                "and clearing its cache index",
                endpoint.name,
                outcome.cached_tokens,
                expected,
            )
            self.forget(endpoint)
        # Whatever it held before, the replica holds this whole prompt now; refresh its recency. Its
        # blocks no longer rest on attempts in flight: another's failure leaves them.
        self.index(endpoint).insert(hashes, confirmed=True)
        credits = self._credits.get(endpoint.name)
        if credits is not None:
            for h in hashes:
                credits.pop(h, None)
            if not credits:
                del self._credits[endpoint.name]
        return Feedback(restart_detected=True) if restarted else NO_FEEDBACK

    def replicas_known(self) -> set[str]:
        """Names the policy keeps a belief about (a cache index, a traffic share, a KV event cursor):
        the replicas routed to since each was last forgotten."""
        return {*self._indexes, *self._traffic_share, *self._cursors, *self._engine_blocks}

    def forget(self, endpoint: Endpoint) -> None:
        """The replica restarted, was taken out of rotation, or left the fleet: what was believed of
        its cache and its recent share of the traffic goes (it comes back at the neutral share, 1/n).
        Per name, only its announced KV capacity stays (one number: a replica announces it at start
        only, so one back from an ejection still needs it); what its attempts in flight booked is
        released as they end (``attempt_over``)."""
        self._indexes.pop(endpoint.name, None)
        self._credits.pop(endpoint.name, None)
        self._queued.forget(endpoint.name)
        self._cursors.pop(endpoint.name, None)
        self._engine_blocks.pop(endpoint.name, None)
        self._traffic_share.pop(endpoint.name, None)

    # ---- precise mode: the replicas' KV cache events ---------------------------------------------------
    def apply_kv_events(self, endpoint: Endpoint, events: Sequence[Any]) -> None:
        """Correct ``endpoint``'s index with one poll's events (``llm_client.kv_events.KvCacheEvent``,
        oldest first). ``cleared``, a ``created`` after stored or removed events, or an event id not
        above the last one seen (the replica restarted and counts from 0 again) empty the index before
        the event applies; a skipped id is a gap (events dropped unread): counted, and the index keeps
        its learned belief. The ``created`` events at a start announce the attention windows; stored
        and removed events of a smaller window than the largest are skipped. Stored blocks are indexed
        by the router hashes rebuilt from their tokens (``EngineBlockMap``)."""
        cursor = self._cursors.setdefault(endpoint.name, _EventCursor())
        index = self.index(endpoint)
        blocks = self._engine_blocks.get(endpoint.name)
        if blocks is None:
            capacity = 4 * self.max_blocks_per_replica
            blocks = self._engine_blocks[endpoint.name] = EngineBlockMap(self.block_size, capacity)
        for event in events:
            data = event.data
            last = cursor.last_event_id
            if (
                data.type == "cleared"
                or (data.type == "created" and cursor.seen_blocks)
                or (last is not None and event.event_id <= last)
            ):
                self.stats.kv_restarts += 1
                log.warning("replica %s reports its KV cache emptied (%s)", endpoint.name, data.type)
                index.clear()
                blocks.clear()
                cursor.max_window, cursor.seen_blocks = None, False
            elif last is not None and event.event_id > last + 1:
                self.stats.kv_gaps += 1
                log.warning(
                    "replica %s: KV events %d..%d were dropped before this poll; its index stays learned",
                    endpoint.name,
                    last + 1,
                    event.event_id - 1,
                )
            cursor.last_event_id = event.event_id
            self.stats.kv_events += 1
            window = event.window_size
            if data.type == "created":
                if window is not None and (cursor.max_window is None or window > cursor.max_window):
                    cursor.max_window = window
                    if data.num_blocks_per_cache_level:  # the full-attention pool's GPU blocks
                        blocks_held = data.num_blocks_per_cache_level[0]
                        self._kv_capacity[endpoint.name] = blocks_held * self.block_size
                        # the engine-hash map holds what the replica holds, however the index is bounded
                        blocks.capacity = max(blocks.capacity, 4 * blocks_held)
                continue
            if data.type not in ("stored", "removed"):
                continue
            cursor.seen_blocks = True
            if window is not None and cursor.max_window is not None and window < cursor.max_window:
                self.stats.kv_events_other_window += 1
                continue
            if data.type == "stored":
                rebuilt = blocks.stored(data.parent_hash, data.blocks)
                self.stats.kv_blocks_unrebuilt += len(data.blocks) - len(rebuilt)
                if rebuilt:
                    index.insert(rebuilt, confirmed=True)
            else:
                gone = blocks.removed(data.block_hashes)
                index.remove(gone)
                self.stats.kv_blocks_removed += len(gone)

    # ---- block credits: what a failed attempt takes back ------------------------------------------
    def _credit(self, request: RouteRequest, replica: str, held: int) -> None:
        """``request``'s new attempt on ``replica`` counts on the blocks of its prompt routing records
        there (those past the ``held`` leading blocks the index held) and on those of the held ones that
        rest on other attempts in flight."""
        self._release_credit(request, replica)  # an earlier attempt there is over
        attempt = next(self._attempt_ids)
        credits = self._credits.setdefault(replica, {})
        for i, h in enumerate(self.block_hashes(request)):
            credit = credits.get(h)
            if credit is None:
                if i < held:
                    continue
                credit = credits[h] = _BlockCredit()
            credit.attempts.add(attempt)
        ids: dict[str, int] = request.memo.setdefault(_CREDIT, {})  # type: ignore[assignment]
        ids[replica] = attempt

    def _release_credit(self, request: RouteRequest, replica: str) -> int | None:
        """The attempt on ``replica`` no longer counts on its blocks (they stay in the index); its id,
        or None if it held no credit (released already, or never routed)."""
        ids = request.memo.get(_CREDIT)
        if not isinstance(ids, dict) or replica not in ids:
            return None
        attempt: int = ids.pop(replica)
        credits = self._credits.get(replica)
        if credits is not None:
            index = self._indexes.get(replica)
            unheld: list[int] = []
            for h in self.block_hashes(request):
                credit = credits.get(h)
                if credit is not None and attempt in credit.attempts:
                    credit.attempts.discard(attempt)
                    if not credit.attempts:
                        del credits[h]
                        if credit.orphaned and index is not None and not index.is_confirmed(h):
                            unheld.append(h)  # left for this attempt by a failure; nobody computed it
            if not credits:
                del self._credits[replica]
            if unheld and index is not None:
                index.remove(unheld)
        return attempt

    def _taken_back(self, request: RouteRequest, replica: str) -> list[int]:
        """The blocks a failed attempt on ``replica`` takes back: those routing recorded for it beyond
        what the index held, and those an earlier failure left for it, unless another attempt in flight
        there still counts on them (they are left for the last one) or an answer there confirmed them.
        An attempt alone on the replica takes back everything it recorded."""
        indexed_map = request.memo.get(_INDEXED)
        held = int(indexed_map.get(replica, 0)) if isinstance(indexed_map, dict) else 0
        held //= self.block_size
        ids = request.memo.get(_CREDIT)
        attempt = ids.pop(replica, None) if isinstance(ids, dict) else None
        credits = self._credits.get(replica, {})
        index = self._indexes.get(replica)
        gone: list[int] = []
        for i, h in enumerate(self.block_hashes(request)):
            credit = credits.get(h)
            if credit is None:
                # Confirmed by an answer since (or the replica forgotten); or this attempt's end came
                # before its failure (a proxied stream's error event) and released its credit: then what
                # it recorded goes, as for an attempt alone there.
                if attempt is None and i >= held:
                    gone.append(h)
                continue
            if attempt is not None:
                credit.attempts.discard(attempt)
            if credit.attempts:
                credit.orphaned = credit.orphaned or i >= held
            else:
                del credits[h]
                # An orphan left by an earlier failure goes unless a sibling has computed it since.
                orphan_unheld = credit.orphaned and (index is None or not index.is_confirmed(h))
                if i >= held or orphan_unheld:
                    gone.append(h)
        if not credits:
            self._credits.pop(replica, None)
        return gone

    # ---- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _observed_cached_tokens(request: RouteRequest, outcome: RouteOutcome) -> int:
        """The server's cached count in the router's token units: servers count with their own
        tokenizer (llama-server), so the cached *share* of the prompt is what carries over."""
        if outcome.prompt_tokens <= 0:
            return outcome.cached_tokens
        share = min(1.0, outcome.cached_tokens / outcome.prompt_tokens)
        return round(share * request.prompt_tokens)


def _release(counts: dict[tuple[str, str], int], slot: tuple[str, str]) -> None:
    """One fewer for ``slot``; a slot at zero is dropped, so the per-key maps stay as small as what is
    in flight."""
    left = counts.get(slot, 0) - 1
    if left > 0:
        counts[slot] = left
    else:
        counts.pop(slot, None)
