"""A replica's reusable KV blocks, keyed by chained block hashes, with LRU eviction by block.

Because every block hash names its whole prefix (``prompt_assembly.tokens.chained_block_hashes``), the
cache needs no tree: a prompt's reusable prefix is the run of its leading hashes that are present. A
block whose parent was evicted can stay in the table, but lookups stop at the first missing block, so it
is never matched (it simply ages out). To make that rare, every insert or hit touches a prompt's blocks
from leaf to root, so the root ends up most recently used and LRU eviction takes leaves first, like the
radix-tree caches of vLLM, SGLang and TensorRT-LLM.

With an ``events`` buffer, every change is also published as a KV cache event in TensorRT-LLM's format
(``serving.simulator.kv_events``): new blocks as ``stored``, evictions as ``removed``, ``clear`` as
``cleared``; what a router following the events believes is then exactly what the cache holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

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
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._lookups = 0
        self._hits = 0
        self._queried_blocks = 0
        self._hit_blocks = 0
        self._evicted_blocks = 0

    def longest_prefix(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks present, without touching LRU order or counters."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
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
                self._blocks.move_to_end(h)
        return n

    def insert(self, block_hashes: Sequence[int]) -> None:
        """Store (or refresh) a prompt's blocks, evicting least recently used blocks beyond capacity."""
        blocks = self._blocks
        if self.events is not None:
            self._publish_stored(block_hashes)
        for h in reversed(block_hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        overflow = max(len(blocks) - self.capacity_blocks, 0)
        evicted = [blocks.popitem(last=False)[0] for _ in range(overflow)]
        self._evicted_blocks += overflow
        if self.events is not None:
            self.events.removed(evicted)

    def _publish_stored(self, block_hashes: Sequence[int]) -> None:
        """One ``stored`` event per run of consecutive blocks not yet held, with the block before it."""
        assert self.events is not None
        run: list[int] = []
        parent: int | None = None
        for i, h in enumerate(block_hashes):
            if h in self._blocks:
                if run:
                    self.events.stored(parent, run)
                    run = []
                continue
            if not run:
                parent = block_hashes[i - 1] if i > 0 else None
            run.append(h)
        if run:
            self.events.stored(parent, run)

    def clear(self) -> None:
        """Forget every block and counter, as a restarted engine would."""
        self._blocks.clear()
        self._reset_counters()
        if self.events is not None:
            self.events.cleared()

    @property
    def used_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> CacheStats:
        return CacheStats(
            lookups=self._lookups,
            hits=self._hits,
            queried_blocks=self._queried_blocks,
            hit_blocks=self._hit_blocks,
            used_blocks=len(self._blocks),
            capacity_blocks=self.capacity_blocks,
            evicted_blocks=self._evicted_blocks,
        )


def cached_tokens_for(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens served from cache: whole matched blocks, but never the last prompt token, which an
    engine must always compute to produce the first output token's logits."""
    return max(0, min(matched_blocks * block_size, prompt_tokens - 1))


def salted_block_hashes(block_hashes: Sequence[int], cache_salt: str | None) -> list[int]:
    """Mix a tenant's ``cache_salt`` into every block hash, so prompts with different salts never share
    blocks (vLLM and TensorRT-LLM salt the first block, which by chaining changes all of them; salting
    each chained hash has the same effect without re-hashing the tokens)."""
    if not cache_salt:
        return list(block_hashes)
    salt = cache_salt.encode()
    return [xxhash.xxh64_intdigest(h.to_bytes(8, "little") + salt) for h in block_hashes]
