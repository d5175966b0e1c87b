"""Tokenising from a remembered prefix gives exactly the ids and block hashes of the whole prompt, for the
simulated engine's hashes and the router's."""

from __future__ import annotations

import random

import pytest

from prompt_assembly.prefix_tokens import CHUNK_CHARS, BlockHasher, PromptTokenizer
from prompt_assembly.tokens import chained_block_hashes, token_ids
from serving.simulator.block_keys import engine_block_hashes

HASHERS = pytest.mark.parametrize(
    "hasher", [engine_block_hashes, chained_block_hashes], ids=["engine", "router"]
)

# Runs of letters, digits, spaces and other whitespace, and characters of several UTF-8 widths: the
# tokens whose extent depends on the next character are what a reused prefix must not cut wrongly.
_PIECES = ["pirate", "costumes", "abcdefghijkl", " ", "   ", "\n", "\n\n", "\t ", "9", "19.99", "$", "<data>",
           "é", "漢字", "—", " .", "x" * 30, " " * 40]  # fmt: skip


def _text(rnd: random.Random, n: int) -> str:
    return "".join(rnd.choice(_PIECES) for _ in range(n))


def _expected(
    text: str, block_size: int, salt: str | None, hasher: BlockHasher = engine_block_hashes
) -> tuple[list[int], list[int]]:
    ids = token_ids(text)
    return ids, hasher(ids, block_size, salt)


@HASHERS
def test_every_prompt_gets_the_ids_and_hashes_of_its_whole_text(hasher: BlockHasher) -> None:
    rnd = random.Random(7)
    tokenizer = PromptTokenizer(block_size=8, hash_blocks=hasher, capacity=16)
    sessions = [_text(rnd, 400) for _ in range(6)]
    reused = 0
    for _ in range(600):
        i = rnd.randrange(len(sessions))
        text = sessions[i]
        change = rnd.random()
        if change < 0.6:  # the shopper's newest events, at the end
            text += _text(rnd, rnd.randint(1, 80))
        elif change < 0.75:  # an edit somewhere, maybe right at a chunk boundary
            at = rnd.choice(
                [rnd.randrange(len(text) + 1), CHUNK_CHARS * rnd.randint(1, 3) + rnd.randint(-2, 2)]
            )
            at = min(max(at, 0), len(text))
            text = text[:at] + rnd.choice(_PIECES) + text[at:]
        elif change < 0.85:  # the log trimmed from its start
            text = text[rnd.randint(1, 200) :]
        elif change < 0.9:  # cut back at a chunk boundary
            text = text[: CHUNK_CHARS * max(1, len(text) // CHUNK_CHARS - 1)]
        sessions[i] = text
        salt = rnd.choice([None, None, "tenant-a"])
        got = tokenizer.tokens(text, salt)
        assert (got.ids, got.block_hashes) == _expected(text, 8, salt, hasher)
        reused += got.reused_tokens
    assert reused > 0  # the prefixes were found, not only recomputed


def test_a_prompt_extending_the_last_one_reuses_its_tokens() -> None:
    tokenizer = PromptTokenizer(block_size=32, hash_blocks=engine_block_hashes)
    system = "You describe shoppers.\n" * 200
    first = tokenizer.tokens(system + "- viewed a pirate hat\n")
    second = tokenizer.tokens(system + "- viewed a pirate hat\n- added a parrot to cart\n")
    assert first.reused_tokens == 0
    assert second.reused_tokens >= len(first.ids) - CHUNK_CHARS  # all but the last partial chunk
    assert (second.ids, second.block_hashes) == _expected(
        system + "- viewed a pirate hat\n- added a parrot to cart\n", 32, None
    )


def test_prompts_with_another_salt_share_nothing() -> None:
    tokenizer = PromptTokenizer(block_size=32, hash_blocks=engine_block_hashes)
    text = "You describe shoppers.\n" * 200
    tokenizer.tokens(text, "tenant-a")
    other = tokenizer.tokens(text, "tenant-b")
    assert other.reused_tokens == 0
    assert (other.ids, other.block_hashes) == _expected(text, 32, "tenant-b")


def test_it_remembers_at_most_its_capacity() -> None:
    tokenizer = PromptTokenizer(block_size=32, hash_blocks=engine_block_hashes, capacity=3)
    rnd = random.Random(3)
    for _ in range(10):
        tokenizer.tokens(_text(rnd, 600))
    assert len(tokenizer._prompts) == 3
    assert {id(p) for p in tokenizer._by_chunk.values()} <= {id(p) for p in tokenizer._prompts.values()}
