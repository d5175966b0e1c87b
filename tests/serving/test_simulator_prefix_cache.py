"""Block prefix cache: matching, LRU by block, clearing, tenant salts, and the never-whole-prompt rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_assembly.tokens import chained_block_hashes, token_ids
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.prefix_cache import BlockPrefixCache, cached_tokens_for

BS = 4


def _hashes(ids: list[int]) -> list[int]:
    return chained_block_hashes(ids, BS)


def test_match_counts_leading_blocks_only() -> None:
    cache = BlockPrefixCache(capacity_blocks=100, block_size=BS)
    a = _hashes(list(range(16)))
    cache.insert(a)
    assert cache.match(a) == 4
    b = _hashes([*range(8), 99, *range(9, 16)])  # diverges in the third block
    assert cache.match(b) == 2
    assert cache.match(_hashes([7, *range(1, 16)])) == 0
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.hit_blocks, stats.used_blocks) == (3, 2, 6, 4)


def test_lru_evicts_least_recent_leaves_first_and_keeps_shared_roots() -> None:
    cache = BlockPrefixCache(capacity_blocks=6, block_size=BS)
    shared = list(range(8))
    a = _hashes([*shared, *range(100, 108)])
    b = _hashes([*shared, *range(200, 208)])
    cache.insert(a)  # 4 blocks
    cache.insert(b)  # 2 new blocks; shared root refreshed
    assert cache.used_blocks == 6
    c = _hashes([*range(300, 308)])
    cache.insert(c)  # evicts a's two leaf blocks, the least recently used
    assert cache.match(a) == 2
    assert cache.match(b) == 4
    assert cache.match(c) == 2
    assert cache.stats().evicted_blocks == 2


def test_eviction_takes_the_leaf_so_the_prefix_stays_reachable() -> None:
    cache = BlockPrefixCache(capacity_blocks=3, block_size=BS)
    a = _hashes(list(range(12)))
    cache.insert(a)
    cache.insert(_hashes([50, 51, 52, 53]))  # evicts one block: a's leaf, not its root
    assert cache.match(a) == 2


def test_prompt_larger_than_the_cache_keeps_its_leading_blocks() -> None:
    cache = BlockPrefixCache(capacity_blocks=3, block_size=BS)
    a = _hashes(list(range(40)))
    cache.insert(a)
    assert cache.match(a) == 3


def test_clear_forgets_blocks_and_counters() -> None:
    cache = BlockPrefixCache(capacity_blocks=10, block_size=BS)
    a = _hashes(list(range(8)))
    cache.insert(a)
    cache.match(a)
    cache.clear()
    assert cache.match(a) == 0
    assert cache.used_blocks == 0
    assert cache.stats().hits == 0


def test_salts_isolate_tenants() -> None:
    cache = BlockPrefixCache(capacity_blocks=100, block_size=BS)
    ids = list(range(16))
    cache.insert(engine_block_hashes(ids, BS, "tenant-a"))
    assert cache.match(engine_block_hashes(ids, BS, "tenant-a")) == 4
    assert cache.match(engine_block_hashes(ids, BS, "tenant-b")) == 0
    assert cache.match(engine_block_hashes(ids, BS)) == 0
    assert engine_block_hashes(ids, BS, None) == engine_block_hashes(ids, BS, "")


def test_cached_tokens_never_covers_the_whole_prompt() -> None:
    assert cached_tokens_for(matched_blocks=4, block_size=4, prompt_tokens=16) == 15
    assert cached_tokens_for(matched_blocks=3, block_size=4, prompt_tokens=16) == 12
    assert cached_tokens_for(matched_blocks=0, block_size=4, prompt_tokens=1) == 0
    assert cached_tokens_for(matched_blocks=1, block_size=4, prompt_tokens=1) == 0


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(st.integers(0, 5), min_size=1, max_size=120),
    second=st.lists(st.integers(0, 5), min_size=1, max_size=120),
    shared=st.integers(0, 120),
)
def test_cached_tokens_bounded_and_repeat_gets_all_full_blocks(
    first: list[int], second: list[int], shared: int
) -> None:
    cache = BlockPrefixCache(capacity_blocks=1000, block_size=BS)
    second = first[:shared] + second
    cache.insert(_hashes(first))
    for prompt in (first, second):
        blocks = _hashes(prompt)
        cached = cached_tokens_for(cache.match(blocks), BS, len(prompt))
        assert 0 <= cached <= len(prompt) - 1
    cache.insert(_hashes(second))
    for prompt in (first, second):
        cached = cached_tokens_for(cache.match(_hashes(prompt)), BS, len(prompt))
        assert cached == min(len(prompt) // BS * BS, len(prompt) - 1)


def test_real_text_prefixes_share_exactly_their_common_full_blocks() -> None:
    cache = BlockPrefixCache(capacity_blocks=1000, block_size=32)
    prefix = " alpha" * 100  # 100 tokens: 3 full blocks
    a, b = token_ids(prefix + " beta" * 40), token_ids(prefix + " gamma" * 40)
    cache.insert(chained_block_hashes(a, 32))
    assert cache.match(chained_block_hashes(b, 32)) == 3
