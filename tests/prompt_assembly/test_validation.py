"""The first problem of a pydantic error, as the gateway, the simulator and batch name it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from prompt_assembly.validation import first_problem


class Item(BaseModel):
    count: int


class Document(BaseModel):
    items: list[Item]


def _error(document: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        Document.model_validate(document)
    return caught.value


def test_the_first_problem_is_named_by_its_dotted_path() -> None:
    path, message = first_problem(_error({"items": [{"count": 1}, {"count": "many"}, {"count": "none"}]}))
    assert path == "items.1.count"
    assert "integer" in message


def test_a_document_that_is_no_object_has_no_path() -> None:
    path, message = first_problem(_error([1, 2]))
    assert path is None
    assert "dictionary" in message or "object" in message
