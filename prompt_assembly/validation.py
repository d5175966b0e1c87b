"""How a pydantic ``ValidationError`` is named at the edges: its first problem, as a field path and a
message, so that a 400 (the gateway, the simulator) and a batch error line say the same thing the same
way. Only the first: a caller fixes one thing at a time, and a body with a thousand bad items must not
make a thousand-line answer."""

from __future__ import annotations

from pydantic import ValidationError


def first_problem(exc: ValidationError) -> tuple[str | None, str]:
    """``(path, message)`` of ``exc``'s first error; ``path`` is dotted (``messages.0.content``), None
    where the document itself is wrong (not an object)."""
    first = exc.errors()[0]
    path = ".".join(str(part) for part in first["loc"]) or None
    return path, first["msg"]
