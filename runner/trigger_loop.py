"""Pending triggers fired on the wall clock: a shopper who stops browsing gets a prompt once the quiet
period has passed, with no further event to show it.

A trigger's due time is in event time (the session decides it); the runner arms a *relative* wall
deadline, ``timer_wall_per_event_s`` wall seconds per event second after the shopper's last event
(``wall_deadline``), so a replayed backlog does not fire one prompt per event. The queue itself is
``runner.timers.TimerQueue``; the re-arming of an assignment's timers is ``runner.handover``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prompt_assembly.session import ShopperSession
from runner.epochs import Epoch

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner


class TriggerLoop:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner

    def wall_deadline(self, session: ShopperSession) -> float:
        assert session.pending is not None
        wait = max(0.0, session.pending.due_ts - session.last_event_ts)
        return self.runner.timers.now() + wait * self.runner.settings.timer_wall_per_event_s

    async def run(self) -> None:
        """Fire the due triggers, pass after pass; none while a revoke hands partitions over
        (``runner.handover``): the timers stay armed, nothing is popped, and each trigger stays pending
        in its session, saved with it at the hand-over's durable point for the next owner to re-arm. A
        pass awaits nothing between the check and the last launch, so none is left half done."""
        runner = self.runner
        while True:
            await runner.handover.settled()
            fired: set[str] = set()
            epoch = Epoch(lease=runner.assignment.lease)
            for sid, due_ts, version in runner.timers.pop_due():
                session = runner.sessions.get(sid)
                if session is None:
                    continue
                prompts = runner.processor.fire_armed(session, due_ts, version)
                for prompt in prompts:
                    runner.prompts.launch(prompt, epoch, None)
                if prompts:
                    fired.add(sid)
            if fired:
                runner.close_epoch(epoch, fired)
            await runner.timers.wait()

    def fire_all(self) -> None:
        """End of an ``until_drained`` run: every pending trigger fires now, in one epoch."""
        runner = self.runner
        epoch = Epoch(lease=runner.assignment.lease)
        fired = set()
        for sid, session in runner.sessions.items():
            for prompt in runner.processor.flush(session):
                runner.prompts.launch(prompt, epoch, None)
                fired.add(sid)
        runner.close_epoch(epoch, fired)
        runner.timers.clear()
