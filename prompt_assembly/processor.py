"""The whole per-shopper step, shared by every engine shell: apply an event to a session, decide
triggers, and turn a due trigger into a prompt request.

Engines keep the session (Redis, Flink keyed state), deliver each shopper's events in order, and call:
- ``apply`` for each event;
- ``fire_pending`` when a processing-time timer set for ``session.pending.due_ts`` goes off;
- ``flush`` when a bounded input ends (every pending trigger fires).
Everything here is deterministic in the events, so replays and different engines agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from prompt_assembly.events import EventTimeWindow, ShopperEvent
from prompt_assembly.prompt import TASK_TOKENS, build_messages, head_tokens, render_event
from prompt_assembly.records import PromptRequest, TriggerReason, request_id
from prompt_assembly.session import ShopperSession, session_epoch
from prompt_assembly.tokens import count_tokens
from prompt_assembly.triggers import TriggerPolicy


class SessionConfig(BaseModel):
    triggers: TriggerPolicy = Field(default_factory=TriggerPolicy)
    max_log_tokens: int = Field(3300, ge=200, description="token budget of the activity log")
    trim_to_fraction: float = Field(
        0.35, gt=0, lt=1, description="after a trim the log holds at most this share of the budget"
    )
    max_events: int = Field(400, ge=4, description="hard cap on events kept per shopper")
    remember_trimmed_ids: int = Field(512, ge=0, description="ids of trimmed events kept for dedup")
    event_time: EventTimeWindow = Field(
        default_factory=EventTimeWindow,
        description="event times the gate accepts around each record's Kafka timestamp",
    )


@dataclass(frozen=True, slots=True)
class Applied:
    outcome: Literal["accepted", "duplicate"]
    prompts: list[PromptRequest]


class SessionProcessor:
    def __init__(self, config: SessionConfig | None = None) -> None:
        self.config = config or SessionConfig()

    def new_session(self, shopper_id: str) -> ShopperSession:
        return ShopperSession(shopper_id)

    def apply(self, session: ShopperSession, event: ShopperEvent, raw: bytes | None = None) -> Applied:
        """Add ``event`` and return the prompts due. ``raw`` (the record it was parsed from) is accepted
        for the engines' sake and not kept: a session stores only the event's schema fields."""
        if session.has_seen(event.event_id):
            return Applied("duplicate", [])
        if session.arrivals == 0 and session.epoch == 0:
            session.epoch = session_epoch(event.ts)
        prompts: list[PromptRequest] = []
        pending = session.pending
        if pending is not None and event.ts >= pending.due_ts:
            prompts.append(self._emit(session, pending.reason, pending.due_ts))
        session.add(event, raw)
        if len(session.entries) > self.config.max_events:
            keep = int(self.config.max_events * self.config.trim_to_fraction)
            session.trim_head(len(session.entries) - keep, self.config.remember_trimmed_ids)
        session.pending = self.config.triggers.next_pending(session, event)
        if session.pending.due_ts <= event.ts:
            prompts.append(self._emit(session, session.pending.reason, event.ts))
        return Applied("accepted", prompts)

    def fire_pending(self, session: ShopperSession, due_ts: float) -> list[PromptRequest]:
        """Timer callback: fires the pending trigger if it is still due by ``due_ts`` (a timer armed
        for an earlier due time than the current one is stale and does nothing)."""
        pending = session.pending
        if pending is None or pending.due_ts > due_ts:
            return []
        return [self._emit(session, pending.reason, pending.due_ts)]

    def fire_armed(
        self, session: ShopperSession, due_ts: float, version: tuple[int, int] | None = None
    ) -> list[PromptRequest]:
        """A timer armed for the trigger due at ``due_ts`` when the session's prompt version was
        ``version`` is due (the embedded runner's wall-clock timers, which keep stale entries): fires
        the pending trigger only if it is that one. A stale entry of an earlier trigger must not fire a
        newer one that is due sooner (a late cart add's rate limit under a browse pause's entry) before
        its own timer, nor one with the same due time armed after a prompt (a late event after a pause
        fired): the runner then prompted without the events the Flink job's prompt held, whose stale
        timer is deleted when it re-arms or fires."""
        pending = session.pending
        if pending is None or pending.due_ts != due_ts:
            return []
        if version is not None and version != (session.epoch, session.seq):
            return []
        return [self._emit(session, pending.reason, pending.due_ts)]

    def flush(self, session: ShopperSession) -> list[PromptRequest]:
        """End of a bounded input: the pending trigger fires now, whatever its due time."""
        pending = session.pending
        return [] if pending is None else [self._emit(session, pending.reason, pending.due_ts)]

    def _emit(self, session: ShopperSession, reason: TriggerReason, due_ts: float) -> PromptRequest:
        for entry in session.entries:
            if entry.line is None:
                entry.line = render_event(entry.event)
                entry.tokens = count_tokens(entry.line)
        lines = [e.line for e in session.entries if e.line is not None]
        counts = [e.tokens for e in session.entries]
        log_tokens = sum(counts)
        if log_tokens > self.config.max_log_tokens:
            target = self.config.max_log_tokens * self.config.trim_to_fraction
            drop = 0
            while drop < len(counts) - 1 and log_tokens > target:
                log_tokens -= counts[drop]
                drop += 1
            session.trim_head(drop, self.config.remember_trimmed_ids)
            lines, counts = lines[drop:], counts[drop:]
        new_event_ids = [e.event.event_id for e in session.entries if e.segment >= session.seq]
        head = head_tokens(session.shopper_id)
        if session.seq == 0:
            shared = 0
        elif session.trimmed_since_prompt:
            shared = head
        else:
            shared = session.last_log_tokens
        request = PromptRequest(
            request_id=request_id(session.shopper_id, session.epoch, session.seq + 1),
            shopper_id=session.shopper_id,
            session_epoch=session.epoch,
            seq=session.seq + 1,
            reason=reason,
            messages=build_messages(session.shopper_id, lines),
            event_count=len(lines),
            new_event_ids=new_event_ids,
            trimmed_event_ids=list(session.unprompted_trimmed_ids),
            trimmed_events=session.unprompted_trimmed,
            last_event_ts=session.last_event_ts,
            due_ts=due_ts,
            prompt_tokens=head + log_tokens + TASK_TOKENS,
            shared_prefix_tokens=shared,
        )
        session.mark_prompted(head + log_tokens, due_ts)
        return request
