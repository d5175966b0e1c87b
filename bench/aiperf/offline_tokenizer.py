"""Run by the aiperf virtualenv's interpreter (``python -I offline_tokenizer.py HF_HOME``), never imported
by the project: writes a tokenizer aiperf loads with no network.

aiperf needs a Hugging Face tokenizer to build its synthetic prompts (it samples token windows from its
own corpus and decodes them), and ``--tokenizer builtin`` downloads tiktoken's encoding on first use. No
tokenizer can be downloaded here, so this trains one: a ``tokenizers`` WordLevel model (one id per
whitespace-separated word, no merges) on the corpus aiperf itself ships,
``aiperf/dataset/generator/assets/shakespeare.txt``, with the vocabulary uncapped so every word of the
corpus has an id (no ``[UNK]`` in a generated prompt). The same pinned aiperf wheel gives the same corpus,
so the same tokenizer. It is saved with ``PreTrainedTokenizerFast.save_pretrained`` into a Hugging Face
cache layout (``HF_HOME/hub/models--local--NAME/snapshots/REV/``, ``refs/main`` holding REV), which is
what aiperf's loader resolves offline (``HF_HUB_OFFLINE=1``); a plain folder path is taken for a hub id.

Token counts in the measurements do not come from it: the bench runs aiperf with
``--use-server-token-count``, so they are the simulator's (``prompt_assembly.tokens``, which also splits
on words), and this tokenizer only sizes and decodes the synthetic prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aiperf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

NAME = "local/shakespeare-wordlevel"
"""What ``aiperf --tokenizer`` is given."""
REVISION = "aiperf-corpus-wordlevel-1"
"""The snapshot folder; ``refs/main`` points at it."""
VOCAB_CAP = 1_000_000
"""Far above the corpus's ~37k distinct words: no word is left out."""


def main(hf_home: Path) -> None:
    corpus = Path(aiperf.__file__).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"
    model = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.train([str(corpus)], trainers.WordLevelTrainer(vocab_size=VOCAB_CAP, special_tokens=["[UNK]"]))
    repo = hf_home / "hub" / f"models--{NAME.replace('/', '--')}"
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]").save_pretrained(
        repo / "snapshots" / REVISION
    )
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    print(f"{NAME}: {model.get_vocab_size()} words from {corpus.name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
