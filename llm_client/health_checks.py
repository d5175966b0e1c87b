"""The health loop: ejected replicas come back when ``/health`` answers, quarantined ones when an answer
probe passes (``llm_client.answer_probes``), and the degradation detector's drains are re-judged.

Runs every ``HealthSettings.interval_s`` while the client is started. A cycle waits only for the
``/health`` probes, which are bounded by twice the connect timeout. Answer probes are completions, bounded
only by ``attempt_s``: each runs as a task of its own (one per replica at a time), so one replica that
hangs on its probe cannot hold every other replica's re-admission for that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp

from llm_client.answer_probes import AnswerProber
from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.fleet import Fleet
from llm_client.transport import SessionSource


class HealthChecker:
    def __init__(
        self, config: ClientConfig, fleet: Fleet, session: SessionSource, prober: AnswerProber
    ) -> None:
        self.config = config
        self.fleet = fleet
        self._session = session
        self.prober = prober
        self._task: asyncio.Task[None] | None = None
        self._answer_probes: dict[str, asyncio.Task[None]] = {}
        """The answer probe in flight per replica, if any."""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="llm-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._answer_probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._answer_probes.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval_s)
            await self.check_once()

    async def check_once(self) -> None:
        """One cycle: judge drains, start the answer probes that are due, probe ejected replicas'
        ``/health``."""
        self.fleet.evaluate_health()
        every = self.fleet.every
        for endpoint in every:
            if endpoint.name not in self._answer_probes and self.prober.due(endpoint):
                task = asyncio.create_task(self.prober.probe(endpoint), name=f"answer-probe {endpoint.name}")
                self._answer_probes[endpoint.name] = task
                task.add_done_callback(self._probe_over(endpoint.name))
        await asyncio.gather(*(self.probe(e) for e in every if not e.healthy))

    def _probe_over(self, name: str) -> Callable[[asyncio.Task[None]], None]:
        def over(task: asyncio.Task[None]) -> None:
            if self._answer_probes.get(name) is task:
                del self._answer_probes[name]

        return over

    @property
    def answer_probes_in_flight(self) -> int:
        return len(self._answer_probes)

    async def probe(self, endpoint: Endpoint) -> None:
        """``GET /health``: a 200 re-admits an ejected replica."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s * 2)
            async with self._session().get(endpoint.url + "/health", timeout=timeout) as response:
                if response.status == 200:
                    self.fleet.readmit(endpoint)
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            pass

    async def wait_until_healthy(self, timeout_s: float = 30.0, *, minimum: int | None = None) -> None:
        """Probe every replica now, until all answer, or ``minimum`` of them (start-up helper for CLIs
        and tests); those that do not stay ejected, re-admitted by the health loop when they answer."""
        async with asyncio.timeout(timeout_s):
            while True:
                every = self.fleet.every
                for endpoint in every:
                    endpoint.healthy = False
                await asyncio.gather(*(self.probe(e) for e in every))
                healthy = sum(e.healthy for e in every)
                if healthy == len(every) or (minimum is not None and healthy >= minimum):
                    return
                await asyncio.sleep(0.2)
