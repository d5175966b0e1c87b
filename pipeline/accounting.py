"""Where every event and every prompt went. ``balanced`` is the promise: nothing unaccounted."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Accounting:
    consumed: int = 0
    dead_lettered: int = 0
    rekeyed: int = 0
    """Records whose Kafka key was not their shopper id, produced again keyed by it (the embedded
    runner's repartition: ``runner.repartition``); the copy is consumed and counted again."""
    accepted: int = 0
    duplicates: int = 0
    prompts: int = 0
    insights: int = 0
    errors: int = 0
    superseded: int = 0
    """Prompts not answered on purpose (``prompt_assembly.records.Superseded``): latest wins, or stale."""
    trimmed_unprompted: int = 0
    """Accepted events the session's budget trimmed from its log before any prompt took them, as the
    prompts sent name them (``PromptRequest.trimmed_events``). Not a loss: each is named by its
    shopper's next result; a rising rate says the budget is too small for how often prompts fire."""

    @property
    def events_unaccounted(self) -> int:
        return self.consumed - self.dead_lettered - self.rekeyed - self.accepted - self.duplicates

    @property
    def prompts_unaccounted(self) -> int:
        return self.prompts - self.insights - self.errors - self.superseded

    @property
    def balanced(self) -> bool:
        return self.events_unaccounted == 0 and self.prompts_unaccounted == 0

    def as_dict(self) -> dict[str, int]:
        data = asdict(self)
        data["events_unaccounted"] = self.events_unaccounted
        data["prompts_unaccounted"] = self.prompts_unaccounted
        return data
