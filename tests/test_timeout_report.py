"""The timeout report names the line a hung task waits on (``tests.timeout_report.awaiting``)."""

from __future__ import annotations

import asyncio

from tests.timeout_report import awaiting


async def _innermost(gate: asyncio.Event) -> None:
    await gate.wait()


async def _outer(gate: asyncio.Event) -> None:
    await _innermost(gate)


async def test_a_suspended_task_is_shown_down_to_the_await_it_waits_on() -> None:
    gate = asyncio.Event()
    task = asyncio.create_task(_outer(gate))
    await asyncio.sleep(0)
    chain = awaiting(task.get_coro())
    gate.set()
    await task
    names = [step.rsplit(" in ", 1)[1] for step in chain]
    assert names[:3] == ["_outer", "_innermost", "wait"], chain
    assert chain[0].startswith("test_timeout_report.py:")
