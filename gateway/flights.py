"""One upstream call and its answer, for every caller that waits for it.

A ``Flight`` runs in a task of its own, apart from the caller's handler: it waits for an admission
slot (``gateway.overload``), forwards the request and reads the replica's answer into a buffer, which
each caller (``attach``) reads from the start, chunk by chunk as it arrives (``changed``). That is what
lets the gateway

- let a call with an ``Idempotency-Key`` finish when its caller goes away (the restarted caller's
  repeat joins it, or reuses its kept answer: ``gateway.idempotency``), while a call without one is
  stopped when its only caller leaves (its upstream request closed, as before);
- stop a call from outside when a newer version of its session supersedes it (``supersede``): one
  still waiting for a slot is dropped, one already sent has its upstream request closed.

Everything here runs on the gateway's one event loop; a flight is never shared across loops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from llm_client.errors import LLMError

log = logging.getLogger(__name__)

Stage = Literal["waiting", "sent", "ended"]


@dataclass(frozen=True, slots=True)
class GatewayAnswer:
    """An answer the gateway writes itself (no replica's): an OpenAI-style error body."""

    status: int
    kind: str
    message: str
    param: str | None = None
    attempts: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Head:
    """The replica's status line and the headers the caller sees."""

    status: int
    headers: Mapping[str, str]
    streaming: bool


class Flight:
    def __init__(self, *, keep_running: bool) -> None:
        self.keep_running = keep_running
        """Finish the call even when every caller has left (it has an ``Idempotency-Key``)."""
        self.stage: Stage = "waiting"
        self.head: Head | GatewayAnswer | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        """The replica's answer was read to its end."""
        self.error: LLMError | None = None
        """The replica broke off after its status line (nothing could be retried by then)."""
        self.superseded: GatewayAnswer | None = None
        """Set when a newer version of the session stopped this call: what its callers get."""
        self.stopped: GatewayAnswer | None = None
        """The gateway's answer for a call stopped after its status line came (the gateway shutting
        down: 503, ``OpenAIProxy.close``; its task cancelled otherwise, or failed): what a caller still
        waiting for the whole answer gets."""
        self.task: asyncio.Task[None] | None = None
        self._callers = 0
        self._changed = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self.stage == "ended"

    # ---- the runner's side -------------------------------------------------------------------------
    def start(self, task: asyncio.Task[None]) -> None:
        self.task = task
        task.add_done_callback(self._task_done)

    def sent(self) -> None:
        """Admitted: the request is on its way to a replica."""
        self.stage = "sent"

    def answer_head(self, head: Head) -> None:
        self.head = head
        self._notify()

    def append(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        self._notify()

    def end(
        self, *, complete: bool = False, error: LLMError | None = None, answer: GatewayAnswer | None = None
    ) -> None:
        """The call is over: read to its end, broken off (``error``), or answered by the gateway."""
        if self.ended:
            return
        if answer is not None:
            if self.head is None:
                self.head = answer
            else:
                self.stopped = answer
        self.complete = complete
        self.error = error
        self.stage = "ended"
        self._notify()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # Not kept once done: a cancelled or failed task holds its exception, whose traceback holds the
        # flight's frame, which holds this flight, so the task here would close a reference cycle and
        # leave the whole call (its body, route and buffers) to the cyclic collector.
        self.task = None
        if task.cancelled():
            self.end(answer=self.superseded or GatewayAnswer(499, "cancelled", "the call was stopped"))
        elif (exc := task.exception()) is not None:
            log.error("gateway flight failed", exc_info=exc)
            self.end(answer=GatewayAnswer(500, "internal_error", f"the gateway failed: {exc!r}"))
        else:
            self.end()

    def _notify(self) -> None:
        # A pulse: wakes every caller waiting now (their futures are resolved by ``set``), and the
        # next wait waits again. No new event per chunk: this runs once for every chunk of every answer.
        self._changed.set()
        self._changed.clear()

    # ---- from outside ------------------------------------------------------------------------------
    def supersede(self, answer: GatewayAnswer, *, cancel_in_flight: bool) -> Stage | None:
        """A newer version of the session arrived: stop this call if it still waits for a slot, or
        (``cancel_in_flight``) if it was sent. Returns the stage it was stopped at, None if it goes on."""
        if self.ended or self.task is None or (self.stage == "sent" and not cancel_in_flight):
            return None
        stage = self.stage
        self.superseded = answer
        self.task.cancel()
        return stage

    # ---- the callers' side ----------------------------------------------------------------------------
    def attach(self) -> None:
        self._callers += 1

    def detach(self) -> None:
        """A caller is done with the answer (or went away). A call nobody waits for any more is
        stopped, its upstream request closed, unless it is to finish for a repeat (``keep_running``)."""
        self._callers -= 1
        if self._callers <= 0 and not self.keep_running and not self.ended and self.task is not None:
            self.task.cancel()

    async def changed(self) -> None:
        """Until the call's state changes: its head, a chunk, or its end."""
        await self._changed.wait()

    def body_bytes(self) -> bytes:
        return b"".join(self.chunks)
