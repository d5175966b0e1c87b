"""Deterministic stand-in answers: the simulator's "model output". NOT a language model.

The text is derived from a hash of the prompt and from words of the last user message (its last 2,000
characters), so the same request always gets the same answer, in every replica, and answers look
plausible in logs (product and brand names come back). Nothing here understands the prompt.

With ``response_format`` of type ``json_schema`` (OpenAI shape), trtllm's ``json`` (``schema`` beside the
type) or ``json_object``, the answer is JSON that validates against the schema: the schema is walked
generically (objects, arrays, strings with enum/length/format, numbers with bounds, booleans, ``anyOf`` /
``oneOf`` with null, ``$ref`` into ``$defs``), the way guided decoding would constrain a real model. A JSON
answer is never cut: if it does not fit ``max_tokens`` a minimal instance (required fields only, fewest
items, one word per string) is used, and ``completion_tokens`` is still capped at ``max_tokens``.
Regex ``pattern`` constraints are not honoured. The shopper understanding schema is the exception: its
answer is derived from the activity log in the prompt (``shopper_answer``), so demos read like the product.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from prompt_assembly.tokens import tokenize
from serving.simulator.shopper_answer import is_understanding_schema, shopper_understanding

FinishReason = Literal["stop", "length"]

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9'&-]{2,}")
_STOPWORDS_TEXT = """
the and for with that this from into your you are was were have has had not but all any can will
would should could about over under then than them they their there these those what which who
whom whose when where why how our out its his her she him i me my we us also just only very more
most some such own same other each both few many much per via yes no user system assistant
please return json answer question based following given
"""
_STOPWORDS = frozenset(_STOPWORDS_TEXT.split())
_FALLBACK_WORDS = ("Catalog", "Product", "Shopper", "Item", "Brand", "Category", "Offer", "Basket")
_LONG_TEXT_HINTS = ("summary", "description", "reason", "rationale", "explanation", "note", "text")
_MAX_DEPTH = 8
_WORD_WINDOW_CHARS = 2000
_MAX_CANDIDATES = 64


@dataclass(frozen=True)
class Answer:
    """What the simulated model returns: ``pieces`` are the token strings (``"".join(pieces) == text``)
    streamed in order; ``completion_tokens`` is what usage reports (at most ``max_tokens``)."""

    text: str
    pieces: tuple[str, ...]
    completion_tokens: int
    finish_reason: FinishReason


class UnfollowableSchema(ValueError):
    """A ``response_format`` schema no answer can be built from (a wrong type for a keyword, a
    reference to itself that every instance must follow): trtllm-serve's grammar compiler refuses such a
    schema with a 400 before the request is queued, and so does the simulator."""


_SCHEMA_FAILURES = (ValueError, TypeError, OverflowError, RecursionError, AttributeError, KeyError)
"""What a schema with keywords of the wrong type or shape makes the filler raise."""


def plan_answer(
    prompt_text: str,
    last_user_text: str,
    max_tokens: int,
    response_format: Mapping[str, Any] | None = None,
    *,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> Answer:
    """The answer to a prompt; same inputs, same answer."""
    seed = xxhash.xxh64_intdigest(prompt_text.encode())
    words = _candidate_words(last_user_text or prompt_text)
    kind = (response_format or {}).get("type", "text")
    if kind in ("json_schema", "json", "json_object"):
        schema = _schema_of(response_format or {})
        if is_understanding_schema(schema):
            understanding = shopper_understanding(last_user_text or prompt_text)
            pieces = tuple(tokenize(json.dumps(understanding, ensure_ascii=False)))
            if len(pieces) <= max_tokens:
                return Answer("".join(pieces), pieces, len(pieces), "stop")
        try:
            return _json_answer(schema, words, seed, max_tokens)
        except _SCHEMA_FAILURES as exc:
            raise UnfollowableSchema(f"response_format schema cannot be followed: {exc!r}"[:300]) from None
    rng = random.Random(seed)
    natural = 40 + seed % 400
    target = max_tokens if ignore_eos else min(max(natural, min_tokens), max_tokens)
    finish: FinishReason = "length" if ignore_eos or max(natural, min_tokens) > max_tokens else "stop"
    pieces = tuple(tokenize(_prose(words, rng, target))[:target])
    return Answer("".join(pieces), pieces, len(pieces), finish)


def _schema_of(response_format: Mapping[str, Any]) -> Mapping[str, Any] | None:
    if response_format.get("type") == "json_schema":
        wrapper = response_format.get("json_schema") or {}
        # OpenAI nests the schema under json_schema.schema; trtllm also accepts the bare schema there.
        schema = wrapper.get("schema", wrapper if "type" in wrapper or "properties" in wrapper else None)
        return schema if isinstance(schema, Mapping) else None
    if response_format.get("type") == "json":
        schema = response_format.get("schema")
        return schema if isinstance(schema, Mapping) else None
    return None


def _json_answer(
    schema: Mapping[str, Any] | None, words: Sequence[str], seed: int, max_tokens: int
) -> Answer:
    """The full instance of ``schema`` when it fits ``max_tokens``, else its minimal instance (only the
    required parts); a schema whose minimal instance is far past any answer is refused."""
    built = _instance(schema, words, seed, max_tokens, minimal=False)
    if built is None or len(built[1]) > max_tokens:
        built = _instance(schema, words, seed, max_tokens, minimal=True)
        if built is None:
            raise UnfollowableSchema(
                f"the smallest instance of the response_format schema is far longer than max_tokens "
                f"({max_tokens}) holds"
            )
    text, pieces = built
    return Answer(text, tuple(pieces), min(len(pieces), max_tokens), "stop")


def _instance(
    schema: Mapping[str, Any] | None, words: Sequence[str], seed: int, max_tokens: int, *, minimal: bool
) -> tuple[str, list[str]] | None:
    """One instance of ``schema`` as JSON text and its tokens; None when it outgrew the room an answer of
    ``max_tokens`` has (``_BuildRoom``). Both instances start from the same random state: a generator
    seeded again (saving and restoring its 625-word state cost more than seeding)."""
    room = _BuildRoom.for_answer(max_tokens)
    try:
        value = _SchemaFiller(schema, words, random.Random(seed), minimal=minimal, room=room).fill()
    except _TooLarge:
        return None
    text = json.dumps(value, ensure_ascii=False)
    return text, tokenize(text)


class _TooLarge(Exception):
    """The instance being built outgrew its ``_BuildRoom``."""


class _BuildRoom:
    """How much of an instance may be built for an answer of ``max_tokens``: a schema's ``minItems`` or
    ``minLength`` may ask for more than any answer holds (300,000 items for 5 tokens), and building it
    would hold the event loop for seconds. Well past what the answer can hold (an answer longer than
    ``max_tokens`` is still built whole and its usage capped, as long as it stays in this room)."""

    def __init__(self, values: int, chars: int) -> None:
        self.values, self.chars = values, chars

    @classmethod
    def for_answer(cls, max_tokens: int) -> _BuildRoom:
        return cls(values=4 * max_tokens + 256, chars=64 * max_tokens + 4096)

    def take(self, values: int = 0, chars: int = 0) -> None:
        self.values -= values
        self.chars -= chars
        if self.values < 0 or self.chars < 0:
            raise _TooLarge


def _candidate_words(text: str) -> list[str]:
    """Content words of the text's tail (the most recent events), capitalised ones (product, brand,
    category names) first; the tail and the cap keep this O(1) in prompt length."""
    seen: set[str] = set()
    capitalised: list[str] = []
    others: list[str] = []
    # Each distinct word once, in order of first sight: a repeat would be skipped below anyway, and
    # a log's tail repeats most of its words.
    for word in dict.fromkeys(_WORD.findall(text, max(len(text) - _WORD_WINDOW_CHARS, 0))):
        word = word.strip("'-&")
        if len(word) < 3 or word in seen or word.lower() in _STOPWORDS:
            continue
        seen.add(word)
        (capitalised if word[0].isupper() else others).append(word)
        if len(seen) >= _MAX_CANDIDATES:
            break
    return capitalised or others or list(_FALLBACK_WORDS)


def _prose(words: Sequence[str], rng: random.Random, n_words: int) -> str:
    """Sentences of prompt words; every word is at least one token, so ``n_words`` words give at least
    ``n_words`` tokens."""
    out: list[str] = []
    sentence_left = 0
    for _ in range(n_words):
        word = rng.choice(words)
        if sentence_left == 0:
            sentence_left = rng.randint(6, 14)
            word = word[:1].upper() + word[1:]
            if out:
                out[-1] += "."
        out.append(word)
        sentence_left -= 1
    return " ".join(out) + "."


class _SchemaFiller:
    """Builds one instance of a JSON schema from prompt words; ``minimal`` keeps it as small as valid."""

    def __init__(
        self,
        root: Mapping[str, Any] | None,
        words: Sequence[str],
        rng: random.Random,
        *,
        minimal: bool,
        room: _BuildRoom,
    ) -> None:
        self._root = root or {}
        self._words = words
        self._rng = rng
        self._minimal = minimal
        self._room = room

    def fill(self) -> Any:
        if not self._root:
            return {"answer": self._phrase(1 if self._minimal else 4)}
        return self._value(self._root, depth=0, hint="")

    def _value(self, schema: Any, depth: int, hint: str) -> Any:
        self._room.take(values=1)
        if schema is True or not isinstance(schema, Mapping):
            return self._phrase(1)
        schema = self._resolve(schema)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return self._rng.choice(list(schema["enum"]))
        if "allOf" in schema:
            return self._value(self._merge_all_of(schema), depth, hint)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._value(self._pick_branch(schema[key], depth), depth, hint)
        kind = self._type_of(schema, depth)
        if kind == "null":
            return None
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth, hint)
        if kind == "boolean":
            return self._rng.random() < 0.5
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        return self._string(schema, hint)

    def _resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        seen = 0
        while "$ref" in schema and seen < 32:
            ref = str(schema["$ref"])
            target: Any = self._root
            if ref.startswith("#"):
                for part in [p for p in ref[1:].split("/") if p]:
                    target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
            merged = dict(target) if isinstance(target, Mapping) else {}
            merged.update({k: v for k, v in schema.items() if k != "$ref"})
            schema = merged
            seen += 1
        return schema

    def _merge_all_of(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = self._resolve(part) if isinstance(part, Mapping) else {}
            for key, value in part.items():
                if key == "properties":
                    merged["properties"] = {**merged.get("properties", {}), **value}
                elif key == "required":
                    merged["required"] = sorted({*merged.get("required", []), *value})
                else:
                    merged.setdefault(key, value)
        return merged

    def _pick_branch(self, branches: Sequence[Any], depth: int) -> Any:
        def is_null(b: Any) -> bool:
            return isinstance(b, Mapping) and self._resolve(b).get("type") == "null"

        non_null = [b for b in branches if not is_null(b)]
        nullable = len(non_null) < len(branches)
        if nullable and (self._minimal or depth >= _MAX_DEPTH or not non_null):
            return {"type": "null"}
        return non_null[0] if non_null else {"type": "null"}

    def _type_of(self, schema: Mapping[str, Any], depth: int) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            options = [k for k in kind if k != "null"]
            if "null" in kind and (self._minimal or depth >= _MAX_DEPTH or not options):
                return "null"
            kind = options[0] if options else "null"
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties: Mapping[str, Any] = schema.get("properties", {})
        required = list(schema.get("required", []))
        names = required if self._minimal or depth >= _MAX_DEPTH else [*properties, *required]
        extra = schema.get("additionalProperties", {})
        out: dict[str, Any] = {}
        for name in names:
            if name in out:
                continue
            sub = properties.get(name, extra if isinstance(extra, Mapping) else {})
            out[name] = self._value(sub, depth + 1, name)
        return out

    def _array(self, schema: Mapping[str, Any], depth: int, hint: str) -> list[Any]:
        lo = int(schema.get("minItems", 0))
        self._room.take(values=lo)  # before a list of them is built
        hi = int(schema.get("maxItems", max(lo, 3)))
        prefix = list(schema.get("prefixItems", []))
        items = schema.get("items", {})
        if isinstance(items, list):  # draft-4 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        if self._minimal or depth >= _MAX_DEPTH:
            n = lo
        else:
            n = self._rng.randint(max(lo, 1), max(lo, min(hi, max(lo, 1) + 2)))
        n = min(max(n, lo), hi)
        out: list[Any] = []
        attempts = 0
        while len(out) < n and attempts < 4 * n + 8:
            attempts += 1
            position = len(out)
            if position < len(prefix):
                item = self._value(prefix[position], depth + 1, hint)
            elif items is False:
                break
            else:
                item = self._value(items, depth + 1, hint)
            if schema.get("uniqueItems") and item in out:
                continue
            out.append(item)
        return out

    def _integer(self, schema: Mapping[str, Any]) -> int:
        lo, hi = _integer_bounds(schema)
        value = self._rng.randint(lo, hi)
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0 and math.ceil(lo / step) * step <= hi:
            value = math.ceil(lo / step) * step
        return value

    def _number(self, schema: Mapping[str, Any]) -> float:
        lo, hi = _bounds(schema, default_span=1.0)
        exact = lo + (hi - lo) * self._rng.uniform(0.25, 0.75)
        value = round(exact, 2)
        if not lo <= value <= hi or (value in (lo, hi) and lo != hi):
            value = exact
        step = schema.get("multipleOf")
        if isinstance(step, int | float) and step > 0:
            value = math.ceil(lo / step) * step
        return value

    def _string(self, schema: Mapping[str, Any], hint: str) -> str:
        fmt = schema.get("format")
        if fmt in _FORMATTED:
            return _FORMATTED[fmt](self._rng, self._words)
        if self._minimal:
            n_words = 1
        elif any(h in hint.lower() for h in _LONG_TEXT_HINTS):
            n_words = self._rng.randint(5, 10)
        else:
            n_words = self._rng.randint(1, 3)
        text = self._phrase(n_words)
        max_len = schema.get("maxLength")
        min_len = int(schema.get("minLength", 0))
        self._room.take(chars=max(min_len, 0))
        if isinstance(max_len, int):
            text = text[:max_len].rstrip() or text[:max_len]
        if len(text) < min_len:
            text = (text + " " + self._phrase(max(1, min_len // 4))).strip()
            text = text.ljust(min_len, "x")
            if isinstance(max_len, int):
                text = text[:max_len]
        return text

    def _phrase(self, n_words: int) -> str:
        if n_words <= len(self._words):
            return " ".join(self._rng.sample(self._words, n_words))
        return " ".join(self._rng.choice(self._words) for _ in range(n_words))


def _bounds(schema: Mapping[str, Any], default_span: float) -> tuple[float, float]:
    def bound(inclusive: str, exclusive: str) -> float | None:
        value = schema.get(inclusive)
        ex = schema.get(exclusive)
        if isinstance(ex, int | float) and not isinstance(ex, bool):
            value = ex if value is None else (max(value, ex) if inclusive == "minimum" else min(value, ex))
        return None if value is None else float(value)

    lo = bound("minimum", "exclusiveMinimum")
    hi = bound("maximum", "exclusiveMaximum")
    if lo is None and hi is None:
        lo, hi = 0.0, default_span
    elif lo is None:
        assert hi is not None
        lo = min(0.0, hi - default_span)
    elif hi is None:
        hi = lo + default_span
    return lo, max(lo, hi)


def _integer_bounds(schema: Mapping[str, Any]) -> tuple[int, int]:
    """Inclusive integer bounds; understands both numeric (2019+) and boolean (draft 4) exclusives."""
    lo: int | None = None
    hi: int | None = None
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    ex_min, ex_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(minimum, int | float):
        lo = math.floor(minimum) + 1 if ex_min is True else math.ceil(minimum)
    if isinstance(ex_min, int | float) and not isinstance(ex_min, bool):
        lo = max(lo if lo is not None else -(2**62), math.floor(ex_min) + 1)
    if isinstance(maximum, int | float):
        hi = math.ceil(maximum) - 1 if ex_max is True else math.floor(maximum)
    if isinstance(ex_max, int | float) and not isinstance(ex_max, bool):
        hi = min(hi if hi is not None else 2**62, math.ceil(ex_max) - 1)
    if lo is None and hi is None:
        return 0, 100
    if lo is None:
        assert hi is not None
        return min(0, hi - 100), hi
    if hi is None:
        return lo, lo + 100
    return lo, max(lo, hi)


def _date_time(rng: random.Random, words: Sequence[str]) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"


def _date(rng: random.Random, words: Sequence[str]) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _email(rng: random.Random, words: Sequence[str]) -> str:
    return f"{re.sub(r'[^a-z0-9]', '', rng.choice(words).lower()) or 'shopper'}@example.com"


def _uri(rng: random.Random, words: Sequence[str]) -> str:
    return f"https://example.com/{re.sub(r'[^a-z0-9]', '', rng.choice(words).lower()) or 'item'}"


def _uuid(rng: random.Random, words: Sequence[str]) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:32]}"


_FORMATTED = {"date-time": _date_time, "date": _date, "email": _email, "uri": _uri, "uuid": _uuid}
