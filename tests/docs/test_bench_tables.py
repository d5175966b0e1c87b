"""A number in ``docs/`` that quotes a results file equals that file: every table between
``<!-- bench:table NAME results... -->`` markers is what ``python -m bench.report`` renders from the
results JSON it names. ``test_doc_references`` only proves a cited results file exists; this proves the
numbers copied from it are still its numbers. After a rerun, ``python -m bench.report --write`` updates
the tables; a hand edit to one of them fails here.

Tables are rendered once per test module (``rendered``): the stress scenarios' bootstrap intervals take
seconds each, and several docs quote the same results."""

from __future__ import annotations

import difflib
import re

import pytest

from bench.common import REPO
from bench.report import BLOCK, RENDERERS, Rendered, blocks, documents, regenerate


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return {}


def test_every_generated_table_equals_what_its_results_files_give(rendered: Rendered) -> None:
    stale = []
    for doc in documents():
        for block in blocks(doc, cache=rendered):
            if not block.current:
                diff = difflib.unified_diff(
                    block.written.splitlines(), block.rendered.splitlines(), "docs", "results", lineterm=""
                )
                stale.append(f"{doc.relative_to(REPO)} {block.name}:\n" + "\n".join(diff))
    assert not stale, "run `python -m bench.report --write`:\n" + "\n\n".join(stale)


def test_every_renderer_has_a_table_in_the_docs() -> None:
    used = {match["name"] for doc in documents() for match in BLOCK.finditer(doc.read_text())}
    assert used == set(RENDERERS), f"renderers without a table: {sorted(set(RENDERERS) - used)}"


def test_a_hand_edited_number_is_caught_and_regenerated(rendered: Rendered) -> None:
    doc = REPO / "docs" / "routing.md"
    text = doc.read_text()
    match = next(BLOCK.finditer(text))
    # the first number of the first table row, one higher: what a hand edit or a stale copy looks like
    row = match["body"].splitlines()[2]
    number = re.search(r"\| (\d+) \|", row)
    assert number is not None
    edited_row = row.replace(number.group(0), f"| {int(number.group(1)) + 1} |", 1)
    edited = text.replace(row, edited_row, 1)
    assert edited != text
    assert not all(block.current for block in blocks(doc, edited, cache=rendered))
    assert regenerate(edited, cache=rendered) == regenerate(text, cache=rendered)
    assert all(block.current for block in blocks(doc, regenerate(edited, cache=rendered), cache=rendered))
