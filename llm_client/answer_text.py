"""The JSON object inside a model's answer text.

Guided decoding holds a replica to bare JSON, but an unguided one (a small model, a replica without a
grammar backend) wraps it in a code fence or a sentence. Every answer parser (the shopper
understanding, the product understanding, the ranking) reads the same slice, so it lives here once.
"""

from __future__ import annotations


def json_object_text(text: str) -> str | None:
    """From the first ``{`` to the last ``}``, or ``None`` where the text holds no such span.

    A fence's tag and backticks, and prose before or after, lie outside it; what lies inside is left
    to the caller's decoder to accept or refuse."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    return text[start : end + 1]
