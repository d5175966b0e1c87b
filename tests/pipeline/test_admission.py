"""The admission gate on its own (no I/O): the limit follows the fleet as it is read, a waiter
cancelled at any point holds no slot, and ranks are served smallest first."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import get_args

from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from pipeline.admission import URGENT_CLASS, AdmissionGate, Evicted, Rank
from pipeline.enrichment import Enricher, EnrichmentSettings
from pipeline.overload import OverloadSettings
from prompt_assembly.records import PromptRequest, TriggerReason, request_id


async def settle() -> None:
    """Let every task that can run, run (a few loop turns; no wall-clock waiting)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_limit_is_read_at_every_admission() -> None:
    replicas = [1]
    gate = AdmissionGate(lambda: replicas[0], by_priority=True)
    await gate.acquire((0, 0))
    second = asyncio.create_task(gate.acquire((0, 1)))
    third = asyncio.create_task(gate.acquire((0, 2)))
    await settle()
    assert (gate.active, gate.waiting) == (1, 2)
    replicas[0] = 3  # capacity shifting moved two replicas into the pool
    fourth = asyncio.create_task(gate.acquire((0, 3)))  # the next arrival fills the new slots in order
    await asyncio.gather(second, third)
    assert (gate.active, gate.waiting, fourth.done()) == (3, 1, False)
    replicas[0] = 2  # and moved two out again: a release admits no one until below the limit
    gate.release()
    await settle()
    assert (gate.active, gate.waiting, fourth.done()) == (2, 1, False)
    gate.release()
    await settle()
    assert (gate.active, gate.waiting, fourth.done()) == (2, 0, True)


async def test_a_cancelled_waiter_holds_no_slot() -> None:
    gate = AdmissionGate(lambda: 1, by_priority=False)
    await gate.acquire((0, 0))
    waiter = asyncio.create_task(gate.acquire((0, 1)))
    granted_then_cancelled = asyncio.create_task(gate.acquire((0, 2)))
    await settle()
    waiter.cancel()
    await settle()
    gate.release()  # the slot goes to the one still waiting...
    granted_then_cancelled.cancel()  # ...which is cancelled before it resumes: the slot is handed on
    await settle()
    assert (gate.active, gate.waiting) == (0, 0)


async def test_the_smallest_rank_goes_first() -> None:
    gate = AdmissionGate(lambda: 1, by_priority=True)
    await gate.acquire((-1, 0))
    order: list[int] = []

    async def one(rank: tuple[int, int]) -> None:
        await gate.acquire(rank)
        order.append(rank[1])
        gate.release()

    tasks = [asyncio.create_task(one(rank)) for rank in [(1, 1), (1, 2), (0, 3), (0, 4)]]
    await settle()
    gate.release()
    await asyncio.gather(*tasks)
    assert order == [3, 4, 1, 2]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def admitted_order(lifo_after_s: float | None) -> list[int]:
    """Four waiters (class 1, then three of class 0) queued at t=0 behind the one slot; one is let in
    at t=0.5, the rest at t=2."""
    clock = Clock()
    gate = AdmissionGate(lambda: 1, by_priority=True, lifo_after_s=lifo_after_s, clock=clock)
    await gate.acquire((-1, 0))
    order: list[int] = []

    async def one(rank: tuple[int, int]) -> None:
        await gate.acquire(rank)
        order.append(rank[1])

    tasks = [asyncio.create_task(one(rank)) for rank in [(1, 1), (0, 2), (0, 3), (0, 4)]]
    await settle()
    clock.now = 0.5  # the oldest has waited 0.5 s: no standing queue yet
    gate.release()
    await settle()
    clock.now = 2.0  # now it has
    for _ in range(3):
        gate.release()
        await settle()
    await asyncio.gather(*tasks)
    return order


async def test_a_standing_queue_is_served_newest_first_within_its_class() -> None:
    assert await admitted_order(lifo_after_s=1.0) == [2, 4, 3, 1]
    assert await admitted_order(lifo_after_s=None) == [2, 3, 4, 1]


async def order_under_a_trickle(gate: AdmissionGate, clock: Clock, rank: Callable[[], Rank]) -> list[str]:
    """The slot held, the oldest prompt waits; then, three times, a newer one arrives 2 s later (the
    queue stands) and a slot comes free. The prompts admitted by then, in order."""
    await gate.acquire((-1, -1))
    order: list[str] = []

    async def one(name: str) -> None:
        await gate.acquire(rank())
        order.append(name)

    tasks = [asyncio.create_task(one("oldest"))]
    await settle()
    for n in range(3):
        clock.now += 2.0
        tasks.append(asyncio.create_task(one(f"newer {n}")))
        await settle()
        gate.release()
        await settle()
    admitted = list(order)  # three slots came free: three admitted, the fourth still waits
    gate.release()
    await asyncio.gather(*tasks)
    return admitted


async def test_the_backfill_is_served_oldest_first_even_while_its_queue_stands() -> None:
    """Backfilled prompts are all past their wait budget. Served newest first once their queue stood,
    a trickle of newer ones kept the oldest waiting (its epoch uncommitted, its sessions pinned) for as
    long as the trickle lasted."""
    clock = Clock()
    gate = AdmissionGate(lambda: 1, by_priority=True, lifo_after_s=1.0, clock=clock)
    assert await order_under_a_trickle(gate, clock, gate.backfill_rank) == ["oldest", "newer 0", "newer 1"]


async def test_a_class_no_budget_bounds_is_served_oldest_first_even_while_its_queue_stands() -> None:
    """Purchase and cart with ``urgent_max_wait_s`` None: no budget drops their oldest waiter. Served
    newest first once their queue stood, arrivals that kept up with the fleet kept the oldest waiting
    for good (its epoch uncommitted), where the docs say their queue only grows while they exceed it."""
    clock = Clock()
    unbounded = frozenset({URGENT_CLASS})
    gate = AdmissionGate(
        lambda: 1, by_priority=True, lifo_after_s=1.0, unbounded_classes=unbounded, clock=clock
    )
    arrivals = itertools.count(1)
    order = await order_under_a_trickle(gate, clock, lambda: (URGENT_CLASS, next(arrivals)))
    assert order == ["oldest", "newer 0", "newer 1"]


async def test_the_enricher_serves_oldest_first_the_classes_it_gives_no_budget() -> None:
    client = LLMClient(ClientConfig(endpoints=["http://127.0.0.1:9"]))
    unbounded = OverloadSettings(urgent_max_wait_s=None)
    assert Enricher(client, EnrichmentSettings(overload=unbounded)).gate.unbounded_classes == {URGENT_CLASS}
    assert Enricher(client, EnrichmentSettings()).gate.unbounded_classes == frozenset()


async def test_an_evicted_waiter_leaves_without_a_slot_and_the_next_one_gets_it() -> None:
    """``evict_oldest`` lets the longest-waiting prompt of a class go (its ``acquire`` raises
    ``Evicted``); it holds nothing, counts no longer as waiting, and a released slot goes on to the
    next. One cancelled just after it was evicted is not counted twice."""
    gate = AdmissionGate(lambda: 1, by_priority=True)
    await gate.acquire((0, 0))
    oldest = asyncio.create_task(gate.acquire((2, 1)))
    newer = asyncio.create_task(gate.acquire((2, 2)))
    last = asyncio.create_task(gate.acquire((2, 3)))
    await settle()
    assert (gate.waiting, gate.waiting_in(2)) == (3, 3)
    gate.evict_oldest(2)
    await settle()
    assert isinstance(oldest.exception(), Evicted)
    assert (gate.active, gate.waiting, gate.waiting_in(2)) == (1, 2, 2)
    gate.evict_oldest(2)  # evicts newer ...
    newer.cancel()  # ... and cancels it before it runs: counted once
    await settle()
    assert newer.cancelled()
    assert (gate.active, gate.waiting) == (1, 1)
    gate.release()
    await last  # the slot goes on to the last waiter
    assert (gate.active, gate.waiting) == (1, 0)
    gate.evict_oldest(2)  # none waits: nothing happens
    assert (gate.active, gate.waiting) == (1, 0)


async def test_a_waiter_cancelled_mid_queue_is_not_counted_as_waiting() -> None:
    """A prompt displaced by its shopper's newer one while others of its class wait on both sides: its
    entry may stay until its task runs, but it no longer waits. Counted, a full backfill (``max_backfill``)
    dropped a prompt it had room for."""
    gate = AdmissionGate(lambda: 1, by_priority=True)
    await gate.acquire((0, 0))
    waiters = [asyncio.create_task(gate.acquire((2, i))) for i in range(3)]
    await settle()
    waiters[1].cancel()
    await settle()
    assert (gate.waiting, gate.waiting_in(2)) == (2, 2)
    gate.evict_oldest(2)
    await settle()
    assert isinstance(waiters[0].exception(), Evicted)
    assert (gate.waiting, gate.waiting_in(2)) == (1, 1), "the cancelled one is skipped, the last one stays"
    gate.release()
    await waiters[2]


def prompt_for(reason: TriggerReason) -> PromptRequest:
    return PromptRequest(
        request_id=request_id("s", 1, 1),
        shopper_id="s",
        session_epoch=1,
        seq=1,
        reason=reason,
        messages=[],
        event_count=1,
        last_event_ts=0.0,
        prompt_tokens=1,
        shared_prefix_tokens=0,
    )


def test_purchase_and_cart_share_the_urgent_class_ahead_of_browse_pauses() -> None:
    """Every trigger has a class; by priority, a purchase ranks with a cart add, before a browse pause
    (the saturated-gate test in tests/pipeline/test_overload.py queues cart adds only)."""
    gate = AdmissionGate(lambda: 1, by_priority=True)
    classes = {reason: gate.class_of(prompt_for(reason)) for reason in get_args(TriggerReason)}
    assert classes["purchase"] == classes["add_to_cart"] == URGENT_CLASS < classes["browse_pause"]
    in_arrival_order = AdmissionGate(lambda: 1, by_priority=False)
    assert {in_arrival_order.class_of(prompt_for(reason)) for reason in get_args(TriggerReason)} == {0}
