"""Small builders the runner tests share."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from llm_client.config import Timeouts
from prompt_assembly.events import EventType, ProductSnapshot, ShopperEvent
from runner.embedded import EmbeddedRunner, RunnerStats
from serving.simulator.testing import running_simulator
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, wait_until

T = TypeVar("T")

STOP_WITHIN_S = 120.0
"""How long ``running`` waits for its runners to stop: a drain that hangs fails the test, not the suite."""


def run_showing_logs(scenario: Coroutine[Any, Any, T], /, **logs: RunnerLog) -> T:
    """``asyncio.run(scenario)``; when it raises, each runner's log is printed first under its name
    (pytest shows the output beside the failure), so a failed run says what the runners did."""
    try:
        return asyncio.run(scenario)
    except BaseException:
        for name, log in logs.items():
            print(f"---- {name} ----\n{log.render()}", flush=True)
        raise


@contextlib.asynccontextmanager
async def running(*runners: EmbeddedRunner) -> AsyncIterator[list[asyncio.Task[RunnerStats]]]:
    """Each runner's ``run`` as a task, in the list yielded. On the way out, whatever happened, every
    runner is asked to stop and each task awaited (within ``STOP_WITHIN_S``), so its drain and close run
    and no consumer stays in the group; the first runner failure among them is raised, even where the
    scenario ended without looking at its task. A runner the scenario cancelled (``asyncio.wait_for``
    timing out) is not a failure: the scenario's own error says more."""
    tasks = [asyncio.create_task(runner.run()) for runner in runners]
    try:
        yield tasks
    finally:
        for runner in runners:
            runner.request_stop()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), STOP_WITHIN_S)
        failure = next((o for o in outcomes if isinstance(o, Exception)), None)
        if failure is not None:
            raise failure


def cart_add(shopper_id: str, ts: float, key: bytes | None = None) -> tuple[bytes, bytes, bool]:
    """A valid add-to-cart record (key, value, malformed=False), keyed by its shopper id unless ``key``
    says otherwise. A cart add prompts at once and leaves no pending trigger (outside the rate limit)."""
    return shopper_record(shopper_id, ts, "add_to_cart", key)


def view(shopper_id: str, ts: float) -> bytes:
    """A valid product view's value. Views inside the quiet period prompt nothing: they only move the
    pending browse pause, which the tests' timer scale never fires on the wall clock."""
    return shopper_record(shopper_id, ts, "view")[1]


def shopper_record(
    shopper_id: str, ts: float, kind: EventType, key: bytes | None = None
) -> tuple[bytes, bytes, bool]:
    event = ShopperEvent(
        event_id=uuid.uuid4().hex,
        shopper_id=shopper_id,
        type=kind,
        ts=ts,
        product=ProductSnapshot(product_id="p-1", title="Trail shoe", price=89.0),
    )
    return shopper_id.encode() if key is None else key, event.to_json(), False


async def stop_while_answers_wait(
    isolated: Isolated,
    log: RunnerLog,
    *,
    records: int,
    in_flight: int,
    answer_delay_ms: int,
    timeouts: Timeouts,
    **settings: object,
) -> EmbeddedRunner:
    """A runner (never until drained) against one simulator replica whose answers start
    ``answer_delay_ms`` late: once it has consumed ``records`` and has ``in_flight`` prompts at the
    replica, it is stopped, and its drain waited for. ``settings``: more ``RunnerSettings`` fields."""
    async with running_simulator(time_scale=0.01, network_rtt_ms=answer_delay_ms) as sim:
        llm = isolated.llm(endpoints=[sim.url], timeouts=timeouts)
        runner = EmbeddedRunner(isolated.runner(llm=llm, until_drained=False, **settings), log=log)
        async with running(runner) as (task,):
            await wait_until(
                lambda: runner.stats.accounting.consumed == records and runner.in_flight == in_flight,
                "every record applied, the prompts at the replica",
            )
            runner.request_stop()  # the drain now waits the answers out
            await asyncio.wait_for(task, answer_delay_ms / 1000 + 60)
        return runner
