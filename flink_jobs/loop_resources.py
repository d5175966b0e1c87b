"""Clients that a PyFlink async function opens on its operator's event loop, closed on that loop.

Why this exists: PyFlink's async operator runs the function's calls on an event loop in a thread it
owns (``AsyncFunctionRunner``). On close it stops that loop, the thread closes it (``loop.close()`` in
a ``finally`` once ``run_forever`` returns), and only then does it call the function's ``close()``.
What the function opened on the loop (a Redis connection pool, an aiobotocore S3 client, an aiohttp
session and its health task, the sink committer's task) can only be closed on that loop, and a closed
loop runs nothing: closing in ``close()`` is too late, and dropping the references leaked sockets on
every restart of a long-lived Python worker.

So the closers registered here run on the loop itself, just before it is closed: ``LoopResources``
wraps that loop's ``close`` and runs every closer there (``run_until_complete``, last opened first
closed, under ``timeout_s``, one failing does not keep the others open); the function's ``close()``
calls ``LoopResources.close``, which waits for that to be done. Where the loop is still running when
the function is closed (a caller that closes before stopping it), the closers run on it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Closer = Callable[[], Awaitable[None]]


class LoopResources:
    def __init__(self, timeout_s: float) -> None:
        """``timeout_s``: how long the closers may take in all (a store that is down must not hold a
        restart)."""
        self.timeout_s = timeout_s
        self._closers: list[Closer] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Lock()
        self._closing = False
        self._done = threading.Event()

    def add(self, closer: Closer) -> None:
        """Call on the event loop that ``closer``'s resource lives on; it runs there before that loop
        closes. Every resource of one ``LoopResources`` must live on the same loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            close = loop.close

            def close_after_resources() -> None:
                try:
                    self._run_closers(loop)
                finally:
                    close()

            loop.close = close_after_resources  # type: ignore[method-assign]
        elif loop is not self._loop:
            raise RuntimeError("LoopResources: every resource must live on one event loop")
        self._closers.append(closer)

    def _claim(self) -> bool:
        """True for the one caller that runs the closers."""
        with self._started:
            if self._closing:
                return False
            self._closing = True
            return True

    def _run_closers(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._claim():
            return
        try:
            loop.run_until_complete(self._close_all())
        except Exception as exc:  # the loop is closing anyway: say why something may be left open
            log.warning("closing the async clients failed: %r", exc)
        finally:
            self._done.set()

    async def _close_all(self) -> None:
        closers, self._closers = self._closers[::-1], []
        try:
            async with asyncio.timeout(self.timeout_s):
                for closer in closers:
                    with contextlib.suppress(Exception):
                        await closer()
        except TimeoutError:
            log.warning("closing the async clients took over %.1f s; the rest are left open", self.timeout_s)

    def close(self) -> bool:
        """From the function's ``close()``: True once every closer has run (or none was added); False
        where they could not all run within ``timeout_s``."""
        loop = self._loop
        if loop is None:
            return True
        if loop.is_closed() and not self._closing:
            return False  # closed without ``close`` being called through the wrapper: nothing can run
        if not loop.is_closed() and loop.is_running() and self._claim():
            future = asyncio.run_coroutine_threadsafe(self._close_all(), loop)
            try:
                future.result(self.timeout_s + 1)
            except Exception as exc:
                log.warning("closing the async clients failed: %r", exc)
            finally:
                self._done.set()
        return self._done.wait(self.timeout_s + 1)

    @property
    def closed(self) -> bool:
        return self._done.is_set()
