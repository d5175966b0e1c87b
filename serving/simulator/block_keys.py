"""The replica's own block hashes: how the simulated engine names the KV blocks it caches.

A real engine keys its block cache with its own hash, and its KV cache events carry that hash beside
each block's token ids: TensorRT-LLM's ``BlockKeyHasher::hash`` (``cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp``) chains each block on its parent's hash (0 at the root), mixes the request's
cache salt into the *first* block only (chaining carries it into every later one), then mixes each
token id. A router cannot compute that hash without the engine's code and version, so it rebuilds its
own hashes from the tokens of the events (NVIDIA Dynamo does; ``llm_client.kv_events``).

The simulator does the same with a different function, so nothing outside it can match its hashes by
accident: xxh3-64 (seeded) over the parent hash, the salt on the first block, and the block's token ids
as little-endian 32-bit integers. The router's hash (``prompt_assembly.tokens.chain_block_hash``) is
xxh64 without salt. ``tests/llm_client/test_routing_kv_events.py`` checks the two never agree.

Pure and deterministic: the same prompt and salt give the same hashes in every process, so context
and generation replicas (and ``serving.disagg_router``, which plays TensorRT-LLM's own router, hashing
as the engine does) agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from prompt_assembly.tokens import pack_token_ids

ENGINE_HASH_SEED = 0x5EED_7E27
"""Seed of the simulated engine's xxh3 block hash (any constant: it only has to differ from the router)."""


def engine_block_hashes(
    ids: Sequence[int], block_size: int, cache_salt: str | None = None, *, known: Sequence[int] = ()
) -> list[int]:
    """The engine's hash of each *full* block of ``ids``; equal hashes at position i mean equal prompts
    (and equal salts) up to the end of block i. Prompts with different salts share no block.
    ``known``: the hashes of the first blocks, already computed for a prompt with the same salt and the
    same tokens up to their end; hashing goes on from there."""
    hashes: list[int] = list(known)
    parent = hashes[-1] if hashes else 0
    salt = cache_salt.encode() if cache_salt else b""
    salt = len(salt).to_bytes(4, "little") + salt if salt else b""
    for start in range(len(hashes) * block_size, len(ids) - block_size + 1, block_size):
        head = parent.to_bytes(8, "little") + (salt if start == 0 else b"")
        block = pack_token_ids(ids[start : start + block_size])
        parent = xxhash.xxh3_64_intdigest(head + block, ENGINE_HASH_SEED)
        hashes.append(parent)
    return hashes
