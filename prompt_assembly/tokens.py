"""A fast, deterministic stand-in tokenizer shared by the prompt budget, the router and the simulator.

Real tokenizers differ per model; what the pipeline needs is (a) a token count close enough to budget
prompts (about 4 characters a token for English, like BPE vocabularies) and (b) a stable split so that
two prompts with a common text prefix share a common token prefix. Splitting on word boundaries with
the leading space kept gives both, and costs one regex pass.

Digits are one token each, and a space before a number is a token of its own, as Qwen2's pre-tokenizer
splits them (``\\p{N}`` alone in ``PRETOKENIZE_REGEX``, transformers' ``tokenization_qwen2.py``; BPE
never merges across pre-tokens): prices, timestamps and ids are most of the digits in a shopper's
activity log, and grouping them in threes counted those prompts about 12% short (docs/simulator.md).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

import xxhash

_PIECE = re.compile(r" ?[A-Za-z]{1,8}|[0-9]| ?[^\sA-Za-z0-9]|\s+")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into token strings; ``"".join(tokenize(t)) == t`` always holds."""
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    """Number of tokens ``tokenize`` would return."""
    return len(_PIECE.findall(text))


class _PieceIds(dict[str, int]):
    """Token string -> id, filled on first sight. A vocabulary of short pieces repeats endlessly, and
    one C-level lookup per token is cheaper than encoding and hashing it again (``token_ids`` runs on
    every prompt the router and the simulator see). Emptied past ``limit`` entries, so a stream of
    unusual text cannot grow it without bound; the ids are a pure function of the piece either way."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __missing__(self, piece: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        value = self[piece] = xxhash.xxh32_intdigest(piece.encode())
        return value


_PIECE_IDS = _PieceIds(limit=1 << 18)


def token_ids(text: str) -> list[int]:
    """Stable 32-bit ids for the tokens of ``text`` (same string, same id, in every process): the
    xxh32 of each piece's UTF-8 bytes."""
    return piece_ids(_PIECE.findall(text))


def pieces_from(text: str, start: int = 0, end: int | None = None) -> list[str]:
    """The token strings of ``text[start:end]``, where ``start`` is where a token begins (the end of the
    one before it): ``tokenize(text)`` from that token on. Every character belongs to a token, so they
    tile the span; the last may be cut short by ``end``, and every one that ends before it is whole."""
    return _PIECE.findall(text, start) if end is None else _PIECE.findall(text, start, end)


def piece_ids(pieces: Sequence[str]) -> list[int]:
    """``token_ids`` of already split token strings."""
    return list(map(_PIECE_IDS.__getitem__, pieces))


def chained_block_hashes(
    ids: Sequence[int], block_size: int, cache_salt: str | None = None, *, known: Sequence[int] = ()
) -> list[int]:
    """Hash of each *full* block of ``block_size`` tokens, chained so that a block's hash names its
    whole prefix (as vLLM, SGLang and TensorRT-LLM's block reuse do): equal hashes at position i mean
    equal prompts up to the end of block i. These are the *router's* hashes; an engine has its own
    (the simulator's: ``serving.simulator.block_keys``), and a router following an engine's KV cache
    events rebuilds these from the events' tokens with ``chain_block_hash``. ``cache_salt`` is not
    hashed (a router's view of a block is its tokens; taken so that this is a
    ``prefix_tokens.BlockHasher``); ``known``: the hashes of the first blocks, already computed for the
    same tokens, to go on from."""
    hashes: list[int] = list(known)
    parent = hashes[-1] if hashes else ROOT_PARENT
    for start in range(len(hashes) * block_size, len(ids) - block_size + 1, block_size):
        parent = chain_block_hash(parent, ids[start : start + block_size])
        hashes.append(parent)
    return hashes


ROOT_PARENT = 0
"""The parent of a prompt's first block in ``chain_block_hash``."""


def chain_block_hash(parent: int, block: Sequence[int]) -> int:
    """The router's hash of one block of token ids whose preceding block hashed to ``parent``
    (``ROOT_PARENT`` for the first block): ``chained_block_hashes`` one step at a time."""
    return xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + pack_token_ids(block))


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian unsigned 32-bit integers (the bytes every block hash here reads)."""
    return struct.pack(f"<{len(ids)}I", *ids)


def messages_text(messages: Sequence[dict[str, str]]) -> str:
    """Flatten chat messages into the text a chat template would see, in order; used wherever the
    pipeline must reason about a chat prompt's token prefix (router, simulator)."""
    return "".join(f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages)
