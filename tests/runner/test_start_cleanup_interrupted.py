"""``StartCleanup`` runs every close even when one is interrupted (a second Ctrl-C, a cancellation), and
raises the interruption after them: the clients behind it hold broker connections and group membership
(``tests/runner/test_start_failure_cleanup.py`` shows the real ones)."""

from __future__ import annotations

import asyncio

import pytest

from runner.start_cleanup import StartCleanup


def test_an_interrupted_close_leaves_no_other_open_and_is_raised() -> None:
    closed: list[str] = []
    logged: list[str] = []

    def interrupted() -> None:
        closed.append("producer")
        raise KeyboardInterrupt

    async def close_consumer() -> None:
        await asyncio.sleep(0)
        closed.append("consumer")

    async def start() -> None:
        async with StartCleanup(logged.append) as start:
            start.on_failure("the redis client", lambda: closed.append("redis"))
            start.on_failure("the producer", interrupted)
            start.on_failure("the consumer", close_consumer)
            raise OSError("the metrics port is taken")

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(start())
    assert closed == ["consumer", "producer", "redis"]
    assert logged == ["the producer not closed after the failed start, interrupted: KeyboardInterrupt()"]


def test_a_failing_close_is_logged_and_the_start_steps_error_is_raised() -> None:
    closed: list[str] = []
    logged: list[str] = []

    def failing() -> None:
        raise RuntimeError("already closed")

    async def start() -> None:
        async with StartCleanup(logged.append) as start:
            start.on_failure("the redis client", lambda: closed.append("redis"))
            start.on_failure("the producer", failing)
            raise OSError("the metrics port is taken")

    with pytest.raises(OSError, match="metrics port"):
        asyncio.run(start())
    assert closed == ["redis"]
    assert logged == ["the producer not closed after the failed start: RuntimeError('already closed')"]


class _Pause:
    """An await that yields once to whoever drives the coroutine."""

    def __await__(self):  # type: ignore[no-untyped-def]
        yield


def test_a_start_closed_while_a_close_waits_closes_without_awaiting_again() -> None:
    """Closing the coroutine (``GeneratorExit``, as a loop torn down with the task pending does) is
    not an interruption to close past: awaiting the next close then would be a RuntimeError."""
    closed: list[str] = []

    async def close(what: str) -> None:
        await _Pause()
        closed.append(what)

    async def start() -> None:
        async with StartCleanup(lambda _: None) as start:
            start.on_failure("the producer", lambda: close("producer"))
            start.on_failure("the consumer", lambda: close("consumer"))
            raise OSError("the metrics port is taken")

    coroutine = start()
    coroutine.send(None)  # the consumer's close is waiting
    coroutine.close()
    assert closed == []
