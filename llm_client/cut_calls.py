"""Calls their caller stopped waiting for, read to the end in the background within a grace, so that
their connection goes back to the pool instead of being closed.

On HTTP/1.1 the only way to tell a replica to stop is to close the connection, and the next call to
that replica then opens a new one: on a 2-core machine a new connection more than doubled a call's CPU
on both sides (446 us more for the caller, 325 us for the server; ``docs/realtime.md``), and over TLS
it is a handshake. Closing buys little for a short call: ``trtllm-serve`` looks for a gone client about
once a second and computes the request until then, so a ranking call of a few hundred milliseconds cut
at its deadline is computed to its end anyway. With a grace, the caller still gets its error at once
(the deadline holds); the exchange goes on in a task of its own and, if the answer arrives within the
grace, its connection is kept. Past the grace the task is cancelled and the connection closed, as
without one. An answer read within the grace is a latency sample like any other, and the slow calls
are the ones cut: ``on_late`` hands it to the caller's fleet, so a replica slower than the callers'
deadlines still shows as slow to the degradation detector and the routing policy (before, only calls
that beat their deadline taught them, and such a replica was never drained).

Reading on pays only while cut calls finish within the grace. On an overloaded fleet they do not (a
cut call has seconds of queue ahead of it): each then holds its connection through the grace and is
closed anyway, and the replica hears of the cut a grace later. So a cut call reads on only while at
least half of the last ``RECENT`` that did finished within it; otherwise it is closed at once, except
every ``PROBE_EVERY``-th and any that comes ``PROBE_INTERVAL_S`` after the last that read on, which read
on to find out whether the fleet has caught up.

A grace of 0 (the default of ``ClientConfig``) closes at once: the stream engines cancel a superseded
prompt to free the replica's slot for the shopper's newer one, and must keep doing so.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Container, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

RECENT = 32
"""Cut calls that read on whose outcome decides whether the next one does."""
PROBE_EVERY = 8
"""While reading on does not pay, one cut call in this many reads on all the same ..."""
PROBE_INTERVAL_S = 1.0
"""... and so does one that comes this long after the last that read on: where few calls are cut (the
fleet has caught up), the verdict of an overload past is soon found out."""


class CutCalls:
    """``run`` an exchange; if its caller is cancelled, the exchange reads on for ``grace_s``.

    Counters for ``/metrics``: ``kept`` (read to the end after the cut: the connection stays open),
    ``closed`` (cut again at the end of the grace, or the client closed: the connection was closed),
    ``failed`` (ended with an error after the cut: nothing learned, the caller had left),
    ``closed_at_once`` (not read on: recent cut calls did not finish within the grace)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._reading: set[asyncio.Task[Any]] = set()
        self._recent: deque[bool] = deque(maxlen=RECENT)
        """Whether each of the last cut calls that read on finished within the grace."""
        self._skipped = 0
        self._last_read_on = float("-inf")
        self.kept = 0
        self.closed = 0
        self.failed = 0
        self.closed_at_once = 0

    @property
    def reading(self) -> int:
        """Exchanges cut by their caller and still reading."""
        return len(self._reading)

    async def run(
        self,
        exchange: Coroutine[Any, Any, T],
        *,
        read_on: bool = True,
        on_late: Callable[[T], None] | None = None,
        closing: Container[asyncio.Task[Any]] = (),
    ) -> T:
        """``exchange``'s result. Without a grace (or with ``read_on`` false: a P/D context step, whose
        server would otherwise hold the prompt's KV blocks for a generation step that never comes) it
        runs in the caller's task, so a cancel closes its connection at once; with one, in a task of its
        own that a cancel of the caller leaves reading. ``on_late``: given the result of an exchange that
        finished after its caller left (read on within the grace), so that what it says is learned.
        ``closing``: callers whose cancel closes the exchange at once even with a grace (attempts on a
        replica the fleet withdrew: its new owner must get it free)."""
        if self.grace_s <= 0 or not read_on:
            return await exchange
        task = asyncio.ensure_future(exchange)
        try:
            # wait, not shield: shield's outer future would hold an error of the exchange a while longer
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            if asyncio.current_task() in closing:
                task.cancel()
                task.add_done_callback(_retrieved)
            else:
                self._read_on(task, on_late)
            del task
            raise
        try:
            return task.result()
        finally:
            # Raised from here, the exchange's error names this frame: holding the task, which holds
            # that error, this frame would close a reference cycle that kept the caller's frames (the
            # whole request) for the cyclic collector.
            del task

    @property
    def paying(self) -> bool:
        """Whether at least half of the recent cut calls that read on finished within the grace."""
        return 2 * sum(self._recent) >= len(self._recent)

    def _read_on(self, task: asyncio.Task[T], on_late: Callable[[T], None] | None) -> None:
        if task.done():
            self._ended(None, on_late, task)
            return
        now = time.monotonic()
        if not self.paying:
            self._skipped += 1
            if self._skipped % PROBE_EVERY and now - self._last_read_on < PROBE_INTERVAL_S:
                task.cancel()  # closes its connection when it next runs, as without a grace
                task.add_done_callback(_retrieved)
                self.closed_at_once += 1
                return
        self._last_read_on = now
        self._reading.add(task)
        cut = asyncio.get_running_loop().call_later(self.grace_s, task.cancel)
        task.add_done_callback(functools.partial(self._ended, cut, on_late))

    def _ended(
        self, cut: asyncio.TimerHandle | None, on_late: Callable[[T], None] | None, task: asyncio.Task[T]
    ) -> None:
        if cut is not None:
            cut.cancel()
        self._reading.discard(task)
        if task.cancelled():
            self.closed += 1
            self._recent.append(False)
        elif task.exception() is not None:  # retrieved, so asyncio does not log it as lost
            self.failed += 1
        else:
            self.kept += 1
            self._recent.append(True)
            if on_late is not None:
                on_late(task.result())

    async def close(self) -> None:
        """Cancel every exchange still reading (their connections close) and wait for them."""
        reading = list(self._reading)
        for task in reading:
            task.cancel()
        if reading:
            await asyncio.gather(*reading, return_exceptions=True)


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # an error that raced the cancel: retrieved, so asyncio does not log it as lost
