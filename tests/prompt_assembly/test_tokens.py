"""The stand-in tokenizer's ids: the router, the simulator and recorded traces all hash them, so they are
a contract (the xxh32 of each piece's UTF-8 bytes), whatever ``token_ids`` keeps to compute them faster."""

from __future__ import annotations

import random

import xxhash

from prompt_assembly.tokens import _PieceIds, token_ids, tokenize

_ALPHABET = "ab Zq 9 0 \n\t .,$<>|é漢-_'\"" + "\u00a0"


def _texts(count: int) -> list[str]:
    rnd = random.Random(11)
    return ["".join(rnd.choice(_ALPHABET) for _ in range(rnd.randint(0, 300))) for _ in range(count)]


def test_token_ids_are_the_xxh32_of_each_piece() -> None:
    for text in [*_texts(500), "Shopper: prefers fun, attention-grabbing costumes ($19.99, 2026-10-31)."]:
        assert token_ids(text) == [xxhash.xxh32_intdigest(piece.encode()) for piece in tokenize(text)]


def test_the_piece_memo_empties_at_its_limit_and_still_answers() -> None:
    ids = _PieceIds(limit=8)
    pieces = [f" w{i}" for i in range(30)]
    assert [ids[p] for p in pieces] == [xxhash.xxh32_intdigest(p.encode()) for p in pieces]
    assert 0 < len(ids) <= 8
