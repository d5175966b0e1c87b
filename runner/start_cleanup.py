"""What the runner's start opened, closed again when a later start step fails.

``EmbeddedRunner.run`` opens its clients one start step at a time (the Redis client, the dead-letter and
repartition producers, the sinks, the consumer, the ops server) before the stream runs; from then on its
shutdown closes them, in the order a shutdown needs (dead letters delivered before the last commit). A
step that failed in between (a sink that cannot open, the metrics port already taken) left every client
made before it open: each librdkafka client kept its broker connections for as long as the runner or
the error was held (the runner's attributes and the traceback's frames hold them), and the consumer went
on to join the group in the background and stayed a member that never polls, holding its share of the
partitions from the group's next owner until librdkafka's ``max.poll.interval.ms`` took it out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

from confluent_kafka import Producer

__all__ = ["StartCleanup", "purge_and_close"]


class StartCleanup:
    """``async with``: when the block ends by an exception (or a cancellation) before ``started``, each
    ``on_failure`` close runs, the newest first; after ``started`` none does. A close that fails is
    logged and the next one still runs: the caller sees the failed start step's own error, never a
    cleanup's. A close interrupted (a second Ctrl-C, a cancellation) is logged too, the others still
    run, and the interruption is raised once they are done."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log = log
        self._closes: list[tuple[str, Callable[[], Awaitable[object] | None]]] = []

    def on_failure(self, what: str, close: Callable[[], Awaitable[object] | None]) -> None:
        """``close`` (``what`` names it in the log) runs if the start fails from here on. A blocking
        close is passed as an awaitable (``asyncio.to_thread``), so that it runs off the loop."""
        self._closes.append((what, close))

    def started(self) -> None:
        """The stream runs: the runner's shutdown closes everything from here, in its own order."""
        self._closes.clear()

    async def __aenter__(self) -> StartCleanup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        closes, self._closes = self._closes, []
        interrupted: BaseException | None = None
        for what, close in reversed(closes):
            try:
                pending = close()
                if pending is not None:
                    await pending
            except Exception as error:
                self._log(f"{what} not closed after the failed start: {error!r}")
            except GeneratorExit:  # the coroutine itself is being closed: it may not await again
                raise
            except BaseException as interruption:  # the clients not yet closed would stay open
                self._log(f"{what} not closed after the failed start, interrupted: {interruption!r}")
                interrupted = interrupted or interruption
        if interrupted is not None:
            raise interrupted


def purge_and_close(producer: Producer) -> None:
    """Close a producer whose queued records may be dropped (``Producer.close``: confluent-kafka 2.13
    and later). Blocking: call it off the loop. After a failed start nothing was produced and nothing
    committed; at a shutdown it comes after the producer's flush and the last durable point, so what
    is still queued is past every offset committed and the next owner replays it. The purge is there
    because ``close`` waits out ``message.timeout.ms`` for whatever is still queued."""
    producer.purge()
    producer.close()
