"""A settings table in ``docs/`` shows the defaults the code has.

A doc lists a settings model's knobs with their defaults (``| `load_factor` | 1.5 | ... |``). The
default lives in the model's field; this test reads each listed table and compares every default it
shows with the field's, so changing a default without its doc fails here (as ``max_blocks_per_replica``
once sat at 8,192 in both, above what the card holds). A row may name several knobs
(``| `min_invalid`, `invalid_share` | 3, 0.5 |``); a default written as a name (```block_size```, for a
field whose default is computed) or with a note after it (``0 (off)``) is compared up to the note, and
a name is only checked to be a field."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
from pydantic import BaseModel

from bench.common import REPO
from llm_client.answer_health import AnswerHealthSettings
from llm_client.degradation import DegradationSettings
from llm_client.routing.prefix_aware import PrefixAwareSettings
from serving.simulator.config import SimulatorConfig

KNOB = re.compile(r"`([a-z_][a-z0-9_]*)`")
FLAG = re.compile(r"`--([a-z0-9-]+)`")


@dataclass(frozen=True)
class SettingsTable:
    doc: str
    header: str
    model: type[BaseModel]
    column: int = 1
    """Which column holds the defaults (the first names the knobs)."""
    flags: bool = False
    """The knobs are named as command-line flags (``--max-num-tokens`` for ``max_num_tokens``)."""


TABLES = [
    SettingsTable("docs/routing.md", "| knob | default | meaning |", PrefixAwareSettings),
    SettingsTable("docs/routing.md", "| `DegradationSettings` | default |", DegradationSettings),
    SettingsTable("docs/routing.md", "| `AnswerHealthSettings`", AnswerHealthSettings),
    SettingsTable("docs/simulator.md", "| flag | env | default |", SimulatorConfig, column=2, flags=True),
]


def knobs(cell: str, flags: bool) -> list[str]:
    if flags:
        return [flag.replace("-", "_") for flag in FLAG.findall(cell)]
    return KNOB.findall(cell)


def table_rows(doc: str, header: str, column: int = 1) -> list[tuple[str, str]]:
    lines = (REPO / doc).read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(header)]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[column]))
    return rows


def shown_equals(shown: str, default: object) -> bool:
    """``shown`` (the doc's cell, a note in brackets after it dropped) is ``default``."""
    text = shown.split(" (")[0].strip().strip("`")
    if default is None:
        return text == "none"
    if isinstance(default, Path):
        return text == os.path.relpath(default, REPO)
    if isinstance(default, bool):
        return text.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(Fraction(text.replace(",", ""))) == float(default)
        except ValueError:
            return False
    return text == str(default)


def mismatches(table: SettingsTable) -> list[str]:
    fields = table.model.model_fields
    wrong = []
    for names_cell, defaults_cell in table_rows(table.doc, table.header, table.column):
        names = knobs(names_cell, table.flags)
        shown = [d.strip() for d in re.split(r",\s*(?![^(]*\))", defaults_cell)]
        if len(names) != len(shown):
            wrong.append(f"{names_cell}: {len(names)} knobs, {len(shown)} defaults ({defaults_cell})")
            continue
        for name, value in zip(names, shown, strict=True):
            if name not in fields:
                wrong.append(f"{name}: not a field of {table.model.__name__}")
                continue
            default = fields[name].default
            if default is None and KNOB.fullmatch(value.split(" (")[0]):
                continue  # computed from another knob, named in the doc
            if not shown_equals(value, default):
                wrong.append(f"{name}: the doc shows {value!r}, the code has {default!r}")
    return wrong


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.model.__name__)
def test_a_settings_table_shows_the_codes_defaults(table: SettingsTable) -> None:
    assert mismatches(table) == []


def test_the_check_catches_a_changed_default() -> None:
    assert shown_equals("1848", 1848) and shown_equals("0 (off)", 0.0) and shown_equals("1/32", 1 / 32)
    assert shown_equals("`off`", "off") and shown_equals("false", False) and shown_equals("none", None)
    assert not shown_equals("8192", 1848) and not shown_equals("true", False)
