"""The session function's expiry timer: a pending trigger's drain timer must not outlive its session.

Why: with ``wall_clock_timers`` off and ``flush_on_drain`` on, a shopper with a pending trigger keeps an
event-time timer at ``Long.MAX`` (``FLUSH_TIMER_TS``) that only a drain reaches; the trigger otherwise
fires only with the shopper's next event. Flink's state TTL (``state_ttl_s``, processing time from the
last write) drops a quiet shopper's session but never a timer, so the drain timer outlived it: timer state
grew with every shopper ever seen, and the session's pending events were never prompted nor counted.

So while a trigger is pending the function also keeps one processing-time timer a little before the
session's TTL runs out (``expiry_deadline_ms``; each save moves the deadline, as it moves the TTL). It
does what the drain would have done for that shopper (``SessionProcessor.flush``), then drops the
session with its timers, which the TTL was about to do. A shopper quiet for that long gets their
prompt then, not never. A save moves only the deadline kept in state, not the timer (no timer write per
event): a timer that goes off before its deadline is registered again at it (``next_expiry``).

Its state (``ExpiryTimer``) has no TTL: it lives exactly as long as the timer, which fires or is deleted
with it, and it keeps how many events the session holds that no prompt has taken. So where the session
expired first anyway (the job was down across the deadline), the timer that finds it gone counts them
(``events_expired_unprompted``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prompt_assembly.session import ShopperSession

EXPIRY_MARGIN_MS = 600_000
"""How long before the state's TTL runs out the expiry timer fires (at most a tenth of the TTL): a late
timer (a busy task) or a restart shorter than this still finds the session."""


@dataclass(frozen=True, slots=True)
class ExpiryTimer:
    """The expiry timer registered for a shopper's pending trigger, as kept in keyed state."""

    fires_at_ms: int
    """The timer registered."""
    deadline_ms: int
    """When it should fire for the session as last saved (``expiry_deadline_ms``): never earlier."""
    unprompted: int
    """Events in the session that no prompt has taken (in its log or trimmed from it) at the last save."""

    def to_state(self) -> str:
        return f"{self.fires_at_ms} {self.deadline_ms} {self.unprompted}"

    @classmethod
    def from_state(cls, raw: str) -> ExpiryTimer:
        fires_at_ms, deadline_ms, unprompted = raw.split(" ")
        return cls(int(fires_at_ms), int(deadline_ms), int(unprompted))


def expiry_deadline_ms(saved_ms: int, ttl_ms: int) -> int:
    """The processing time to fire at for a session written at ``saved_ms`` whose state expires
    ``ttl_ms`` after its last write (``StateTtlConfig.UpdateType.OnCreateAndWrite``)."""
    return saved_ms + ttl_ms - min(EXPIRY_MARGIN_MS, ttl_ms // 10)


def next_expiry(before: ExpiryTimer | None, deadline_ms: int, unprompted: int) -> ExpiryTimer:
    """The expiry timer after a save with a trigger pending: the one registered before stays unless it
    would fire after ``deadline_ms`` (the wall clock stepped back); a new one fires at the deadline."""
    fires_at_ms = deadline_ms if before is None else min(before.fires_at_ms, deadline_ms)
    return ExpiryTimer(fires_at_ms, deadline_ms, unprompted)


def unprompted_events(session: ShopperSession) -> int:
    """Accepted events of ``session`` that no prompt has taken: lost if its state expires now."""
    return len(session.unprompted()) + session.unprompted_trimmed
