"""Tokenising and block hashing a prompt from the longest prefix remembered from earlier prompts.

A shopper's prompts extend one another (the system prompt, then the activity log with the newest events
last), and every real-time prompt starts with the same system prompt. Tokenising and hashing a 3k-token
prompt from scratch was most of a simulated replica's CPU per request, and it is what the router's
``prefix_aware`` policy does for every request too. So each of them keeps a ``PromptTokenizer`` that
remembers its recent prompts and, for a new one, reuses the token ids and block hashes of the longest
remembered text prefix, computing only the rest. The result is exactly ``token_ids`` and the block
hasher's hashes of the whole text (``tests/prompt_assembly/test_prefix_tokens.py``); this only changes
how long it takes.

Why a token is safe to reuse: the tokenizer's pattern (``prompt_assembly.tokens``) matches left to right,
and a match over ``text[s:e]`` is decided by the characters up to and including ``text[e]`` (the one
that stops a run of letters or spaces). So every token that ends before the first character two texts
differ at is the same token in both. Prefixes are found by a chained hash of fixed-size character
chunks (salted with the request's cache salt), checked against the remembered text before use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from prompt_assembly.tokens import piece_ids, pieces_from

CHUNK_CHARS = 512
"""Prefix granularity: a remembered prompt is found by its text up to a multiple of this."""


class BlockHasher(Protocol):
    """The hash of each full block of ``ids`` (``known``: those of the first blocks, already computed
    for the same salt and tokens): ``chained_block_hashes`` for a router, the engine's own in the
    simulator (``serving.simulator.block_keys.engine_block_hashes``)."""

    def __call__(
        self, ids: Sequence[int], block_size: int, cache_salt: str | None = None, *, known: Sequence[int] = ()
    ) -> list[int]: ...


@dataclass(frozen=True)
class _Remembered:
    text: str
    ids: list[int]
    """Shared with the prompts it was reused for, item by item: a slice copies only the references, and
    the ids themselves are the tokenizer's memo's objects, so a remembered prompt costs about 8 bytes a
    token."""
    cuts: tuple[tuple[int, int], ...]
    """Per whole chunk: the tokens that end before the chunk's end, and where the next token starts."""
    hashes: list[int]
    chunk_keys: tuple[int, ...]


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's token ids and the block hasher's hashes of its full blocks. Both lists are also what
    the tokenizer remembers the prompt by: read them, never change them."""

    ids: list[int]
    block_hashes: list[int]
    reused_tokens: int
    """How many of ``ids`` came from a remembered prompt (for tests and profiles)."""


class PromptTokenizer:
    """``token_ids`` and ``hash_blocks`` of a prompt, from the longest remembered prefix on.

    One per replica or routing policy (each remembers what it saw); ``capacity`` prompts are kept,
    least recently used dropped first (a 4k-token prompt takes about 50 KB here, its text included).
    Safe to share between threads (the gateway routes large bodies in worker threads, small ones on its
    loop): a lock guards the memory of prompts, and the tokenizing and hashing, the expensive part, run
    outside it. Unguarded, a thread's lookup met a prompt another had just dropped (``KeyError``)."""

    def __init__(self, block_size: int, hash_blocks: BlockHasher, capacity: int = 256) -> None:
        self.block_size = block_size
        self.hash_blocks = hash_blocks
        self.capacity = capacity
        self._prompts: OrderedDict[int, _Remembered] = OrderedDict()  # by its last chunk key
        self._by_chunk: dict[int, _Remembered] = {}
        self._lock = threading.Lock()

    def tokens(self, text: str, cache_salt: str | None = None) -> PromptTokens:
        keys = _chunk_keys(text, cache_salt)
        with self._lock:
            base, chunks = self._longest_prefix(text, keys)
        if base is None:
            reused, offset = 0, 0
            ids: list[int] = []
            cuts: list[tuple[int, int]] = []
            known: list[int] = []
        else:
            reused, offset = base.cuts[chunks - 1]  # the tokens that end before the texts may differ
            ids = base.ids[:reused]
            cuts = list(base.cuts[:chunks])
            known = base.hashes[: reused // self.block_size]
        pieces = _pieces_and_cuts(text, offset, reused, cuts, len(keys))
        ids += piece_ids(pieces)
        hashes = self.hash_blocks(ids, self.block_size, cache_salt, known=known)
        prompt = _Remembered(text, ids, tuple(cuts), hashes, keys)
        with self._lock:
            self._remember(prompt)
        return PromptTokens(ids, hashes, reused)

    def _longest_prefix(self, text: str, keys: tuple[int, ...]) -> tuple[_Remembered | None, int]:
        """The remembered prompt sharing the most whole chunks with ``text``, and how many (verified,
        so a hash collision cannot reuse another text's tokens)."""
        found: _Remembered | None = None
        chunks = 0
        for i, key in enumerate(keys):
            candidate = self._by_chunk.get(key)
            if candidate is None:
                break
            found, chunks = candidate, i + 1
        if found is None:
            return None, 0
        shared = chunks * CHUNK_CHARS
        if found.text[:shared] != text[:shared]:
            return None, 0
        self._prompts.move_to_end(found.chunk_keys[-1])
        return found, chunks

    def _remember(self, prompt: _Remembered) -> None:
        if not prompt.chunk_keys:
            return  # shorter than a chunk: nothing a later prompt could find it by
        last = prompt.chunk_keys[-1]
        old = self._prompts.pop(last, None)
        if old is not None:
            self._forget(old)
        self._prompts[last] = prompt
        for key in prompt.chunk_keys:
            self._by_chunk[key] = prompt  # the newest prompt through a chunk stands for it
        while len(self._prompts) > self.capacity:
            _, evicted = self._prompts.popitem(last=False)
            self._forget(evicted)

    def _forget(self, prompt: _Remembered) -> None:
        for key in prompt.chunk_keys:
            if self._by_chunk.get(key) is prompt:
                del self._by_chunk[key]


def _pieces_and_cuts(
    text: str, offset: int, reused: int, cuts: list[tuple[int, int]], chunks: int
) -> list[str]:
    """The token strings of ``text`` from ``offset`` (where a token starts) on, appending to ``cuts``
    the cut of every whole chunk after the known ones. Split chunk by chunk: the tokens that reach the
    chunk's end (the last may be cut short there) are split again with the next chunk, so what is kept
    is the whole text's tokens, and each cut's count comes without a running sum over every token."""
    pieces: list[str] = []
    start = offset
    for chunk in range(len(cuts), chunks):
        end_of_chunk = (chunk + 1) * CHUNK_CHARS
        window = pieces_from(text, start, end_of_chunk)  # tiles text[start:end_of_chunk]
        end = end_of_chunk
        while window and end >= end_of_chunk:
            end -= len(window.pop())
        pieces += window
        start = end
        cuts.append((reused + len(pieces), start))
    pieces += pieces_from(text, start)
    return pieces


def _chunk_keys(text: str, cache_salt: str | None) -> tuple[int, ...]:
    """Chained hash of each whole ``CHUNK_CHARS`` chunk of ``text``: key ``i`` names ``text`` up to
    the end of chunk ``i`` (and the salt: prompts with different salts share no block either)."""
    key = xxhash.xxh3_64_intdigest(cache_salt.encode()) if cache_salt else 0
    keys = []
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        key = xxhash.xxh3_64_intdigest(text[start : start + CHUNK_CHARS].encode(), key)
        keys.append(key)
    return tuple(keys)
