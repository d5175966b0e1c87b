"""A trigger loop that fails fails the runner, against the real broker and Redis.

The loop that fires browse pauses runs for the whole run, beside the ingest. An error in it (a bug in
firing one session's trigger) ended its task and nothing watched it: browse pauses stopped for the rest
of the run, health stayed live and ready, and the error surfaced only at the drain, which a runner that
is not ``--until-drained`` reaches only when it is stopped. Now the runner fails at once, like a failed
committer or re-arm.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.helpers import broker_connections, broker_connections_left

pytestmark = pytest.mark.slow


class TriggerBug(RuntimeError):
    pass


def test_a_trigger_loop_that_fails_fails_the_runner_at_once(isolated: Isolated) -> None:
    lines: list[str] = []
    runner = EmbeddedRunner(isolated.runner(until_drained=False), log=lines.append)
    bootstrap = isolated.stack.kafka_bootstrap
    before = broker_connections(bootstrap)

    def broken() -> list[tuple[str, float, tuple[int, int]]]:
        raise TriggerBug("firing a trigger failed")

    async def scenario() -> BaseException | None:
        runner.timers.pop_due = broken  # type: ignore[method-assign]  # the fault: the loop's first step
        task = asyncio.create_task(runner.run())
        try:
            async with asyncio.timeout(30):  # a runner not until-drained runs until it is stopped
                while runner.failure is None:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pass  # went on without its trigger loop: reported below
        finally:
            failure = runner.failure
            runner.request_stop()
            with contextlib.suppress(TriggerBug):
                await task
        return failure

    failure = asyncio.run(scenario())
    assert isinstance(failure, TriggerBug), "the runner went on without its trigger loop"
    assert any("the trigger loop failed" in line for line in lines), lines[-5:]
    # And it shut down whole: the loop's error, raised from the wait for the workers, had skipped the
    # rest of the shutdown (the consumer stayed in the group, the producers and Redis stayed open).
    left = broker_connections_left(bootstrap, before)
    assert left <= 0, f"{left} broker connections left open after the trigger loop failed"
    with pytest.raises(RuntimeError, match="Consumer closed"):
        runner.consumer.memberid()
