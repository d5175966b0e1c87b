"""Cancel a task and wait for its end, even where a library swallows the cancel.

redis-py's asyncio client with a socket timeout (``SinkSettings.redis_timeout_s``, on by default)
swallows about one cancel in four that lands while a command runs: the task goes on as if it had never
been cancelled, and whoever awaited its end after one ``cancel()`` waited for good (a real-time
service's shutdown behind its capacity warm-up loop, renewing a lease every tick). So a stop repeats the
cancel until the task has ended (``tests/capacity/test_background_loop.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

CANCEL_RETRY_S = 0.1
"""How long a cancelled task is waited for before it is cancelled again."""


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again every ``CANCEL_RETRY_S`` until
    it has. Its outcome stays in it (``task.cancelled()``, ``task.exception()``); a cancel of the caller
    itself is raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_RETRY_S)
