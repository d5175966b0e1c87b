"""One background loop an object owns: started at most once, cancelled and awaited on stop.

The pool follower, the capacity shifter, batch's AIMD window and real time's loop-lag probe each run
one such loop beside the work they steer; this is their one copy of the start/stop dance, and of
"a failed step is logged and the loop goes on" for the loops that poll a store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pipeline.cancellation import cancel_and_wait


class BackgroundLoop:
    """``start()`` creates the task running ``body()`` (again only after ``stop()``); ``stop()``
    cancels it and waits until it has ended."""

    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._body = body
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._body(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended; an error it ended with is raised. The cancel is
        repeated until it takes (``pipeline.cancellation``: redis-py can swallow one, and a loop that
        renews a lease went on as if never cancelled). A cancel of the caller itself is raised."""
        task = self._task
        if task is None:
            return
        await cancel_and_wait(task)
        self._task = None
        if not task.cancelled():
            task.result()


async def every(
    interval_s: Callable[[], float], step: Callable[[], Awaitable[object]], log: logging.Logger, what: str
) -> None:
    """Run ``step`` forever, ``interval_s()`` apart. A step that raises (a store hiccup) is logged
    and the loop goes on: what the step last achieved stays in force until the next one."""
    while True:
        try:
            await step()
        except Exception as exc:
            log.warning("%s: %r", what, exc)
        await asyncio.sleep(interval_s())
