"""The gateway routes large bodies in worker threads (``GATEWAY_OFFLOAD_BODY_BYTES``), and small ones on
its loop, all through the ``prefix_aware`` policy's one ``PromptTokenizer``: its memory of recent
prompts is shared by those threads. Unguarded, a lookup met a prompt another thread had just dropped
and raised ``KeyError``, which left the gateway's handler as a bare 500.

Driven here from threads directly, as ``OpenAIProxy._route`` drives it, with a memory of four prompts
(every call evicts one) and the interpreter switching threads as often as it can: a race is made
likely, not waited for.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prompt_assembly.prefix_tokens import CHUNK_CHARS, PromptTokenizer
from prompt_assembly.tokens import chained_block_hashes, token_ids

BLOCK = 32
THREADS = 6
CALLS = 2000
BASE = "You describe shoppers. " * 200
"""Prompts share this prefix, as every prompt shares its system prompt, so they find each other."""


@contextmanager
def switching_threads_often() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _prompt(rng: random.Random) -> str:
    shopper = f" shopper {rng.randint(0, 20)} viewed a lantern;" * rng.randint(1, 40)
    return BASE[: CHUNK_CHARS * rng.randint(1, 8)] + shopper


def test_a_tokenizer_shared_by_routing_threads_answers_every_call_right() -> None:
    tokenizer = PromptTokenizer(BLOCK, chained_block_hashes, capacity=4)
    failures: list[BaseException] = []
    wrong: list[str] = []
    start = threading.Barrier(THREADS)

    def route(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for _ in range(CALLS):
            text = _prompt(rng)
            try:
                tokens = tokenizer.tokens(text)
            except Exception as exc:  # what reached the gateway's handler
                failures.append(exc)
                continue
            if tokens.ids != token_ids(text):
                wrong.append(text)

    threads = [threading.Thread(target=route, args=(seed,)) for seed in range(THREADS)]
    with switching_threads_often():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == [], f"{len(failures)} calls failed, the first: {failures[0]!r}"
    assert wrong == [], f"{len(wrong)} prompts got other token ids than their own"
    text = BASE + " a shopper none of the threads saw"
    assert tokenizer.tokens(text).block_hashes == chained_block_hashes(token_ids(text), BLOCK)
