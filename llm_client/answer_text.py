"""The JSON object inside a model's answer text.

Guided decoding holds a replica to bare JSON, but an unguided one (a small model, a replica without a
grammar backend) wraps it in a code fence or a sentence. Every answer parser (the shopper
understanding, the product understanding, the ranking) reads the same slice, so it lives here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def json_object_text(text: str) -> str | None:
    """From the first ``{`` to the last ``}``, or ``None`` where the text holds no such span.

    A fence's tag and backticks, and prose before or after, lie outside it; what lies inside is left
    to the caller's decoder to accept or refuse."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    return text[start : end + 1]


def schema_field_errors(answer: object, schema: Mapping[str, Any]) -> list[str]:
    """What an object ``schema`` (its ``properties``, ``required`` and ``additionalProperties:
    false``) refuses in a decoded answer's field names: the fields it does not allow and the required
    ones missing. The answer models are lenient there on purpose (they ignore extra fields and default
    optional ones, so they still read records an older or newer build stored), but an answer is
    untrusted input, held to the schema the server was asked to decode with. Empty where the names are
    right, or ``answer`` is no object (the model refuses that itself)."""
    if not isinstance(answer, dict):
        return []
    errors = []
    if schema.get("additionalProperties") is False and (
        extra := sorted(set(answer) - set(schema.get("properties", {})))
    ):
        errors.append(f"fields the schema does not allow: {', '.join(map(repr, extra))}")
    if missing := sorted(set(schema.get("required", ())) - set(answer)):
        errors.append(f"required fields missing: {', '.join(map(repr, missing))}")
    return errors
