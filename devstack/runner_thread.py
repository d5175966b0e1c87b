"""An embedded runner on a thread of its own, with its own event loop: beside a Flink job in the tests
and benchmarks that run both (the engines compared, or the job's prompts topic enriched by a runner
with input 'prompts'), from code that is not itself on an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner
from runner.progress import RunnerStats


class RunnerThread:
    """``start`` runs the runner; ``stop`` asks it to stop as SIGTERM does (no new polls, in-flight
    prompts finish, one last durable point and commit), waits at most ``within_s``, and returns its
    stats or raises what it failed with."""

    def __init__(self, settings: RunnerSettings, *, log: Callable[[str], None] | None = None) -> None:
        self.runner = EmbeddedRunner(settings, log=log if log is not None else lambda _: None)
        self.loop = asyncio.new_event_loop()
        self.stats: RunnerStats | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="embedded-runner", daemon=True)

    def _run(self) -> None:
        try:
            self.stats = self.loop.run_until_complete(self.runner.run())
        except BaseException as exc:  # raised on the caller's thread by ``stop``
            self.error = exc
        finally:
            self.loop.close()

    def start(self) -> RunnerThread:
        self.thread.start()
        return self

    def stop(self, within_s: float = 240.0) -> RunnerStats:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.runner.request_stop)
        self.thread.join(within_s)
        if self.error is not None:
            raise self.error
        if self.stats is None:
            raise TimeoutError(f"the runner did not stop within {within_s:g} s")
        return self.stats
