"""A request's own cancellation wins over its wait bound: when the bound passes, the gateway stops the
request's place in the queue, and a cancellation of the request itself (its caller gone, the session's
newer version, the gateway stopping, or an ``asyncio.timeout`` around it) that arrives while that stop
is awaited is raised, not swallowed into a 429 "waited".

The admission logic is the gateway's own (``gateway.overload.Admission``) with nothing else behind it:
the race is made by order, not by time, so these tests drive it in-process.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import GatewaySettings
from gateway.overload import Admission, Entry, Refused

BOUND_S = 0.05
"""The low class's wait bound here: short, so the waiter reaches it at once."""


def one_slot_admission(refused: list[Refused]) -> Admission:
    settings = GatewaySettings(max_in_flight=1, max_wait_s={"low": BOUND_S})
    return Admission(settings, lambda: 1, refused.append)


async def wait_in_slot(admission: Admission, entry: Entry) -> None:
    entry.owner = asyncio.current_task()
    async with admission.slot(entry):
        raise AssertionError("the only slot is held: this waiter is never granted")


async def cancel_owner_while_its_place_is_stopped(owner: asyncio.Task[None], entry: Entry) -> None:
    """Cancel ``owner`` in the instant its wait bound has passed: the gateway has cancelled the place's
    ``acquire`` (``entry.task``) and waits for it to end."""
    assert entry.task is not None
    while not entry.task.cancelling():
        assert not owner.done(), "the owner ended before its bound passed"
        await asyncio.sleep(0)
    assert not entry.task.done()
    owner.cancel()


async def test_the_owners_cancellation_is_raised_when_it_comes_as_the_bound_passes() -> None:
    refused: list[Refused] = []
    admission = one_slot_admission(refused)
    holder = admission.enter(admission.judge("low"))  # takes the only slot
    entry = admission.enter(admission.judge("low"))  # waits for it
    owner = asyncio.create_task(wait_in_slot(admission, entry))
    await cancel_owner_while_its_place_is_stopped(owner, entry)

    with pytest.raises(asyncio.CancelledError):
        await owner
    assert refused == [], "a cancelled request was counted as refused for its wait"
    assert admission.gate.active == 1 and admission.gate.waiting == 0  # the holder's slot, nothing else
    admission.leave(holder)
    assert admission.gate.active == 0


async def test_a_timeout_around_the_request_still_ends_it_as_a_timeout() -> None:
    """The same instant, from ``asyncio.timeout``: its cancellation must reach it to become TimeoutError."""
    refused: list[Refused] = []
    admission = one_slot_admission(refused)
    admission.enter(admission.judge("low"))
    entry = admission.enter(admission.judge("low"))

    async def within_a_deadline() -> None:
        async with asyncio.timeout(None) as deadline:
            entry.owner = asyncio.current_task()
            assert entry.task is not None
            # Expire the deadline in the instant the gateway stops the place: rescheduled to now, it
            # cancels this task on the loop's next pass, while this task waits for the place to end.
            expire_when_stopping(entry.task, deadline)
            async with admission.slot(entry):
                raise AssertionError("never granted")

    with pytest.raises(TimeoutError):
        await within_a_deadline()
    assert refused == []


def expire_when_stopping(place: asyncio.Task[None], deadline: asyncio.Timeout) -> None:
    """On every pass of the loop until ``place`` is being cancelled and has not ended yet, then expire
    ``deadline`` now."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if place.done():
            return
        if place.cancelling():
            deadline.reschedule(loop.time())
        else:
            loop.call_soon(check)

    loop.call_soon(check)
