"""A gateway flight on its own (no HTTP): a call stopped after its status line came, as the gateway's
shutdown stops every call, ends with the gateway's answer for the callers still waiting for the whole
answer. It ended with neither an answer nor an error, and the waiting handler failed an assertion: the
caller got a plain-text 500 and the log a traceback."""

from __future__ import annotations

import asyncio

from gateway.flights import Flight, GatewayAnswer, Head


async def test_a_call_stopped_after_its_status_line_ends_with_the_gateways_answer() -> None:
    flight = Flight(keep_running=False)
    task = asyncio.create_task(asyncio.sleep(60))
    flight.start(task)
    flight.answer_head(Head(200, {"content-type": "application/json"}, streaming=False))
    task.cancel()
    async with asyncio.timeout(5):
        while not flight.ended:
            await asyncio.sleep(0)
    assert not flight.complete and flight.error is None
    assert isinstance(flight.head, Head), "the status line stays what the replica sent"
    assert flight.stopped == GatewayAnswer(499, "cancelled", "the call was stopped")
