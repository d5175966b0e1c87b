"""When a session deserves a prompt, decided in event time so that every engine, and every replay,
emits the same prompts for the same events.

- ``add_to_cart`` / ``purchase``: now, unless the shopper was prompted less than
  ``min_prompt_interval_s`` ago (event time, counted from when that prompt became due); then at the end
  of that interval (rate limit). A browse pause waits for it too.
- browsing (view, click, search): after ``quiet_period_s`` without activity (debounced), counted from
  the newest event time seen, so a late event never brings the pause forward.
A pending trigger fires either when the shopper's next event shows that its due time has passed, or by
a processing-time timer in the engine shell when no event comes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from prompt_assembly.events import EventType, ShopperEvent
from prompt_assembly.records import TriggerReason
from prompt_assembly.session import PendingTrigger, ShopperSession

_STRENGTH: dict[TriggerReason, int] = {"browse_pause": 0, "add_to_cart": 1, "purchase": 2}


class TriggerPolicy(BaseModel):
    quiet_period_s: float = Field(20.0, gt=0, description="browse pause that triggers a prompt")
    min_prompt_interval_s: float = Field(10.0, ge=0, description="per-shopper rate limit, event time")
    immediate_types: tuple[EventType, ...] = Field(
        ("add_to_cart", "purchase"),
        description="event types that prompt at once; the others wait for a quiet period",
    )

    def next_pending(self, session: ShopperSession, event: ShopperEvent) -> PendingTrigger:
        """The pending trigger after ``event`` was added to ``session``."""
        earliest = (
            event.ts
            if session.last_prompt_ts is None
            else max(event.ts, session.last_prompt_ts + self.min_prompt_interval_s)
        )
        reason: TriggerReason = event.type if event.type in ("add_to_cart", "purchase") else "browse_pause"
        # The quiet period runs from the shopper's newest activity, not from this event: a late event
        # (older than one already in the log) must not make a browse pause fire before it has passed.
        quiet_from = max(event.ts, session.newest_ts)
        due = (
            earliest
            if event.type in self.immediate_types
            else max(earliest, quiet_from + self.quiet_period_s)
        )
        current = session.pending
        if current is not None and _STRENGTH[current.reason] > _STRENGTH[reason]:
            # A cart add waiting on the rate limit keeps its reason and its (earlier) due time.
            return current
        return PendingTrigger(reason, due)
