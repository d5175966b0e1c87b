"""A replica's reusable KV blocks, keyed by chained block hashes, with LRU eviction by block.

Because every block hash names its whole prefix (``serving.simulator.block_keys``: the engine's chained
hashes), the
cache needs no tree: a prompt's reusable prefix is the run of its leading hashes that are present. A
block whose parent was evicted can stay in the table, but lookups stop at the first missing block, so it
is never matched (it simply ages out). To make that rare, every insert or hit touches a prompt's blocks
from leaf to root, so the root ends up most recently used and LRU eviction takes leaves first, like the
radix-tree caches of vLLM, SGLang and TensorRT-LLM.

With an ``events`` buffer, every change is also published as a KV cache event in TensorRT-LLM's format
(``serving.simulator.kv_events``): new blocks as ``stored``, evictions as ``removed``, ``clear`` as
``cleared`` (as ``removed`` while requests in flight keep their pinned blocks); what a router following the
events believes is then exactly what the cache holds.

Pins model the KV memory of requests in flight (the engine uses them only when asked:
``EngineLimits.pin_blocks``). A pinned block is held by a running request (or, on a context replica,
by a prompt waiting to be pulled) and is never evicted; pins are counted, so two requests may pin the same
block. ``reserve`` books room for blocks a request will write (its prefill, or a transfer in flight)
before they have a hash in the table. Eviction only ever takes unpinned blocks, and makes room for the
reservations too: ``used_blocks + reserved_blocks <= capacity_blocks`` holds whenever the unpinned blocks
suffice. Without pins and reservations the cache is the plain LRU it always was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from serving.simulator.kv_events import KvEventBuffer


@dataclass(frozen=True)
class CacheStats:
    """Counters since start or the last ``clear``; ``lookups``/``hits`` count prompts, not blocks."""

    lookups: int
    hits: int
    queried_blocks: int
    hit_blocks: int
    used_blocks: int
    capacity_blocks: int
    evicted_blocks: int


class BlockPrefixCache:
    """LRU set of block hashes with prefix matching; pure and synchronous (no I/O, no clock)."""

    def __init__(self, capacity_blocks: int, block_size: int, events: KvEventBuffer | None = None) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.events = events
        self._blocks: OrderedDict[int, None] = OrderedDict()
        """Unpinned blocks, least recently used first (the only ones eviction may take)."""
        self._pinned: dict[int, int] = {}
        """Pinned blocks and their pin counts; they are out of the LRU order while pinned."""
        self._reserved = 0
        self._tails: dict[int, tuple[int, ...]] = {}
        """Partial reuse: the tokens of the last, partly filled block of a computed prompt, keyed by the
        hash of the full block before it (kept while that block is held)."""
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._lookups = 0
        self._hits = 0
        self._queried_blocks = 0
        self._hit_blocks = 0
        self._evicted_blocks = 0

    def _holds(self, h: int) -> bool:
        return h in self._blocks or h in self._pinned

    def longest_prefix(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks present, without touching LRU order or counters."""
        n = 0
        blocks, pinned = self._blocks, self._pinned
        for h in block_hashes:
            if h not in blocks and h not in pinned:
                break
            n += 1
        return n

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks present; counts a lookup and refreshes the matched blocks."""
        n = self.longest_prefix(block_hashes)
        self._lookups += 1
        self._queried_blocks += len(block_hashes)
        if n:
            self._hits += 1
            self._hit_blocks += n
            for h in reversed(block_hashes[:n]):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
        return n

    def insert(
        self,
        block_hashes: Sequence[int],
        *,
        tokens: Sequence[int] = (),
        pin: bool = False,
        release_reserved: int = 0,
    ) -> list[int]:
        """Store (or refresh) a prompt's blocks, evicting least recently used unpinned blocks beyond
        capacity. With ``pin`` every block of ``block_hashes`` is pinned once more (the caller unpins
        exactly the returned list later); ``release_reserved`` gives back the room booked for them.
        ``tokens`` (the prompt's token ids) go into the ``stored`` events; without them a block's
        ``tokens`` are empty and no router can rebuild its hash."""
        blocks, pinned = self._blocks, self._pinned
        if self.events is not None:
            self._publish_stored(block_hashes, tokens)
        for h in reversed(block_hashes):
            if pin:
                if h in pinned:
                    pinned[h] += 1
                else:
                    blocks.pop(h, None)
                    pinned[h] = 1
            elif h in blocks:
                blocks.move_to_end(h)
            elif h not in pinned:
                blocks[h] = None
        self._reserved = max(self._reserved - release_reserved, 0)
        self._evict()
        return list(block_hashes) if pin else []

    def _evict(self) -> None:
        blocks = self._blocks
        overflow = len(blocks) + len(self._pinned) + self._reserved - self.capacity_blocks
        overflow = min(max(overflow, 0), len(blocks))
        evicted = [blocks.popitem(last=False)[0] for _ in range(overflow)]
        self._evicted_blocks += overflow
        if self._tails:
            for h in evicted:
                self._tails.pop(h, None)
        if self.events is not None:
            self.events.removed(evicted)

    def pin(self, block_hashes: Sequence[int]) -> list[int]:
        """Pin the blocks of ``block_hashes`` that are present (the caller passes a matched prefix);
        returns the pinned hashes, which the caller hands back to ``unpin``."""
        blocks, pinned = self._blocks, self._pinned
        done: list[int] = []
        for h in block_hashes:
            if h in pinned:
                pinned[h] += 1
            elif h in blocks:
                del blocks[h]
                pinned[h] = 1
            else:
                continue
            done.append(h)
        return done

    def unpin(self, block_hashes: Sequence[int]) -> None:
        """Drop one pin of each block; a block with no pins left becomes evictable, most recently used
        (touched leaf to root, like an insert). Blocks the cache no longer has (``clear``) are skipped."""
        pinned, blocks = self._pinned, self._blocks
        for h in reversed(block_hashes):
            count = pinned.get(h)
            if count is None:
                continue
            if count > 1:
                pinned[h] = count - 1
            else:
                del pinned[h]
                blocks[h] = None
        self._evict()

    def blocks_to_hold(self, block_hashes: Sequence[int]) -> int:
        """Blocks of this prompt that are not pinned yet: what holding all of it adds to the pinned
        and reserved memory (an unpinned cached block costs a slot too once pinned)."""
        pinned = self._pinned
        return len({h for h in block_hashes if h not in pinned})

    def missing(self, block_hashes: Sequence[int]) -> int:
        """How many of these blocks the cache does not hold: what storing them adds to ``used_blocks``."""
        return sum(1 for h in set(block_hashes) if not self._holds(h))

    def can_hold(self, blocks: int) -> bool:
        """Whether ``blocks`` more pinned or reserved blocks fit beside what is pinned and reserved now.
        An empty cache takes anything (a prompt larger than the cache runs alone and over-commits)."""
        held = len(self._pinned) + self._reserved
        return held == 0 or held + blocks <= self.capacity_blocks

    def reserve(self, blocks: int) -> None:
        """Book room for ``blocks`` blocks not yet written; unpinned blocks are evicted to make it."""
        self._reserved += blocks
        self._evict()

    def unreserve(self, blocks: int) -> None:
        self._reserved = max(self._reserved - blocks, 0)

    def store_tail(self, block_hashes: Sequence[int], tokens: Sequence[int]) -> None:
        """Remember a computed prompt's partly filled last block (its tokens after the last full block),
        so a later prompt that continues the same way reuses those tokens (``partial_match``)."""
        full = len(block_hashes)
        tail = tokens[full * self.block_size :]
        if full and tail and self._holds(block_hashes[-1]):
            self._tails[block_hashes[-1]] = tuple(tail)

    def partial_match(self, block_hashes: Sequence[int], matched: int, tokens: Sequence[int]) -> int:
        """TensorRT-LLM's partial reuse (``enable_partial_reuse``): how many leading tokens of this
        prompt's first block not held whole (``matched`` blocks are) equal a stored partial block under the
        same parent. Only blocks with a parent: the parent's hash carries a tenant's salt, the root does
        not, so tenants never share a partial block."""
        if matched == 0 or not tokens or not self._tails:
            return 0
        stored = self._tails.get(block_hashes[matched - 1])
        if stored is None:
            return 0
        start = matched * self.block_size
        mine = tokens[start : start + self.block_size]
        n = 0
        for a, b in zip(stored, mine, strict=False):
            if a != b:
                break
            n += 1
        return n

    def _publish_stored(self, block_hashes: Sequence[int], tokens: Sequence[int]) -> None:
        """One ``stored`` event per run of consecutive blocks not yet held, with the block before it
        and each block's token ids."""
        assert self.events is not None
        size = self.block_size
        run: list[int] = []
        run_tokens: list[Sequence[int]] = []
        parent: int | None = None
        for i, h in enumerate(block_hashes):
            if self._holds(h):
                if run:
                    self.events.stored(parent, run, run_tokens)
                    run, run_tokens = [], []
                continue
            if not run:
                parent = block_hashes[i - 1] if i > 0 else None
            run.append(h)
            run_tokens.append(tokens[i * size : (i + 1) * size])
        if run:
            self.events.stored(parent, run, run_tokens)

    def clear(self) -> None:
        """Forget every block no request holds, and every counter, as a restarted engine's cache would be.

        Pinned blocks stay, with their pin counts, as do reservations: a request in flight (or a prompt
        waiting to be pulled) still uses them, and will unpin exactly what it pinned. Dropping them as well
        (as this once did) corrupted the counts: a later request storing the same prompt pinned a block
        once, the earlier request's unpin then took that pin, and the block became evictable under the
        later request.
        Events: ``cleared`` when nothing was pinned, else ``removed`` for the dropped blocks, so a router
        following the events still believes exactly what the cache holds."""
        dropped = list(self._blocks)
        self._blocks.clear()
        self._tails.clear()
        self._reset_counters()
        if self.events is not None:
            if self._pinned:
                self.events.removed(dropped)
            else:
                self.events.cleared()

    @property
    def used_blocks(self) -> int:
        return len(self._blocks) + len(self._pinned)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    def is_pinned(self, h: int) -> bool:
        return h in self._pinned

    def stats(self) -> CacheStats:
        return CacheStats(
            lookups=self._lookups,
            hits=self._hits,
            queried_blocks=self._queried_blocks,
            hit_blocks=self._hit_blocks,
            used_blocks=self.used_blocks,
            capacity_blocks=self.capacity_blocks,
            evicted_blocks=self._evicted_blocks,
        )


def cached_tokens_for(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens served from cache: whole matched blocks, but never the last prompt token, which an
    engine must always compute to produce the first output token's logits."""
    return max(0, min(matched_blocks * block_size, prompt_tokens - 1))
