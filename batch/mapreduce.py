"""The per-product map-reduce state machine (pure): which LLM calls to make, and when a product is done.

A product with one part is one call. A product with ``n`` parts is ``n`` map calls, then reduce
levels: each level groups the previous level's analyses (``documents.reduce_groups``), one call per
group of two or more; a lone last analysis passes up unchanged. The product is done when one analysis
is left. Calls of one product may run concurrently and answer in any order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from batch.documents import (
    ChatMessages,
    DocumentPlan,
    PromptBudget,
    map_messages,
    partial_line,
    reduce_groups,
    reduce_messages,
    reduce_room,
)
from batch.records import ProductRecord
from batch.understanding import ProductUnderstanding
from prompt_assembly.tokens import count_tokens


@dataclass(slots=True)
class LLMCall:
    """One request to make for a product: map of part ``index`` (level 0) or reduce of group
    ``index`` of level ``level - 1``'s analyses."""

    line: int
    kind: Literal["map", "reduce"]
    level: int
    index: int
    messages: ChatMessages
    routing_key: str
    attempt: int = 0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
        }


@dataclass(slots=True)
class RecordWork:
    record: ProductRecord
    plan: DocumentPlan
    budget: PromptBudget
    result: ProductUnderstanding | None = None
    requests: int = 0
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    _level: int = 0
    _answers: list[ProductUnderstanding | None] = field(default_factory=list)

    @property
    def parts(self) -> int:
        return len(self.plan.parts)

    def initial_calls(self) -> list[LLMCall]:
        n = len(self.plan.parts)
        self._answers = [None] * n
        return [
            LLMCall(
                self.record.line,
                "map",
                0,
                i,
                map_messages(self.plan.header, part, i, n),
                self.record.product_id,
            )
            for i, part in enumerate(self.plan.parts)
        ]

    def on_answer(self, call: LLMCall, answer: ProductUnderstanding) -> list[LLMCall]:
        """Record one answer; returns the calls that became possible (empty until a level is full).
        Sets ``result`` when the product is done. Answers of a finished level are ignored."""
        if call.level != self._level or self.result is not None or self._answers[call.index] is not None:
            return []
        self.requests += 1
        self._answers[call.index] = answer
        if any(a is None for a in self._answers):
            return []
        return self._next_level()

    def _next_level(self) -> list[LLMCall]:
        while True:
            answers = [a for a in self._answers if a is not None]
            if len(answers) == 1:
                self.result = answers[0]
                return []
            room = reduce_room(self.plan.header, self.budget)
            groups = reduce_groups([count_tokens(partial_line(i, a)) for i, a in enumerate(answers)], room)
            self._level += 1
            self._answers = [answers[g[0]] if len(g) == 1 else None for g in groups]
            calls = [
                LLMCall(
                    self.record.line,
                    "reduce",
                    self._level,
                    gi,
                    reduce_messages(self.plan.header, [answers[i] for i in g]),
                    self.record.product_id,
                )
                for gi, g in enumerate(groups)
                if len(g) > 1
            ]
            if calls:
                return calls
