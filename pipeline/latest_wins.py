"""Latest wins, per shopper: in one process, only a shopper's newest prompt is worth the fleet's time.

A shopper's prompts extend one another (the next one repeats the whole history and adds to it), so an
older prompt still waiting when a newer one arrives would only produce a signal that is stale on
arrival. ``ShopperClaims`` keeps each shopper's newest claim; a newer version ``(session_epoch, seq)``
takes the claim over and the older one is told to stop (``Claim.displace``). A prompt that arrives
older than the claim is superseded at once; the same ``request_id`` twice for the same events (a replay
while the first is still in flight) joins the first call instead of paying for a second. The same
``request_id`` for other events (a restored Flink job's timer waits for the replay, so its seq ``n`` can
hold an event more than the copy sent before the failure) is the newer prompt: joined, it would get the
first copy's answer and leave that event named by no result, as the answer ledger's ``other_events``.

This is per process: both engines key prompts by shopper, so all of a shopper's prompts meet here.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from prompt_assembly.records import EnrichmentResult, PromptRequest


class Arrival(Enum):
    NEWEST = "newest"
    """The shopper's newest prompt: it holds the claim now."""
    SAME = "same"
    """The prompt already holding the claim (same ``request_id``): join its call."""
    OLDER = "older"
    """Older than the claim: superseded at once."""


CUT_AFTER_PASSES = 2
"""How many passes of the event loop a cut waits (``cut_soon``)."""


def cut_soon(cut: Callable[[], object]) -> None:
    """Run ``cut`` (the cancel of a model call whose answer is no longer wanted) ``CUT_AFTER_PASSES``
    passes of the event loop from now. An answer whose last bytes came in the pass that decided the cut
    is then done, and kept: paid for, it is recorded, not lost. One pass was not enough where the
    decision ran first in its pass (a task step queued by the pass before, as a newer prompt's is):
    that pass's reads came after it, and so did the call's last step, queued behind the cut."""
    loop = asyncio.get_running_loop()

    def later(passes: int) -> None:
        if passes <= 1:
            cut()
        else:
            loop.call_soon(later, passes - 1)

    loop.call_soon(later, CUT_AFTER_PASSES)


@dataclass(eq=False, slots=True)
class Claim:
    prompt: PromptRequest
    task: asyncio.Task[EnrichmentResult] | None = None
    """The work of this prompt (admission, the call, the record); cancelled when it is displaced while
    it waits for admission."""
    call: asyncio.Task[EnrichmentResult] | None = None
    """Its model call, made once admitted: from then on a displaced claim cancels only this, and only
    while it is not done (``_cut``): an answer back is paid for, so it is kept, recorded and landed."""
    in_flight: bool = False
    """Its request has been sent to the fleet (a first attempt started), not only admitted: one still
    waiting for the client's slot, a routable replica or a retry is displaced as queued."""
    sent_at: float | None = None
    """``time.perf_counter()`` when its first attempt started."""
    superseded_by: str | None = None
    cancelled_in_flight: bool = False
    answer_kept: bool = False
    """Its answer came back although its caller went away, and is in the ledger: not spent for nothing."""

    @property
    def version(self) -> tuple[int, int]:
        return (self.prompt.session_epoch, self.prompt.seq)

    def displace(self, newer: PromptRequest, *, cancel_in_flight: bool) -> bool:
        """``newer`` replaces this claim: stop its work unless its answer is in, or it is in flight
        and in-flight calls are let finish. False when its work is kept; True when it is cancelled,
        or its call is to be (``_cut``: unless its answer comes in first)."""
        self.superseded_by = newer.request_id
        if self.task is None or self.task.done():
            return False  # a task already done (dropped as stale, say) is not cancelled
        if self.call is None:  # waiting for admission
            self.task.cancel()
            return True
        if self.call.done() or (self.in_flight and not cancel_in_flight):
            return False
        cut_soon(functools.partial(self._cut, cancel_in_flight))
        return True

    def _cut(self, cancel_in_flight: bool) -> None:
        """Cancel the displaced call unless its answer came in meanwhile (``cut_soon``): that answer
        is paid for, so it is kept. Cancelled at once, the call's last step raised instead, and a
        paid-for answer was lost as ``cancelled_in_flight``."""
        call = self.call
        if call is None or call.done() or (self.in_flight and not cancel_in_flight):
            return
        self.cancelled_in_flight = self.in_flight
        call.cancel()


@dataclass(slots=True)
class ShopperClaims:
    _newest: dict[str, Claim] = field(default_factory=dict)

    def arrive(self, prompt: PromptRequest) -> tuple[Arrival, Claim | None, Claim]:
        """Where ``prompt`` stands: (arrival, the claim it displaced if any, the claim that holds now)."""
        current = self._newest.get(prompt.shopper_id)
        if current is not None:
            if current.prompt.request_id == prompt.request_id and _same_events(current.prompt, prompt):
                return Arrival.SAME, None, current
            if current.version > (prompt.session_epoch, prompt.seq):
                return Arrival.OLDER, None, current
        claim = Claim(prompt)
        self._newest[prompt.shopper_id] = claim
        return Arrival.NEWEST, current, claim

    def leave(self, claim: Claim) -> None:
        """``claim``'s work ended; forget it unless a newer one holds the shopper already."""
        if self._newest.get(claim.prompt.shopper_id) is claim:
            del self._newest[claim.prompt.shopper_id]

    def __len__(self) -> int:
        return len(self._newest)


def _same_events(held: PromptRequest, arriving: PromptRequest) -> bool:
    return (
        held.new_event_ids == arriving.new_event_ids and held.trimmed_event_ids == arriving.trimmed_event_ids
    )
