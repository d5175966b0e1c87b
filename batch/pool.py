"""An endpoint pool as the batch side uses it: one LLM client, a capacity budget, an adaptive limit.

The budget (``per_replica_budget`` x replicas) caps concurrency whatever the controller says; the
AIMD controller (``batch.aimd``) moves the limit inside it from windows of observed completions. When
the capacity shifter moves replicas in or out, ``set_endpoints`` re-points the client and rescales the
limit with the pool's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections import deque
from collections.abc import Mapping, Sequence

from batch.aimd import AimdController, AimdSettings, WindowStats
from capacity.background import BackgroundLoop
from llm_client.client import LLMClient
from llm_client.errors import (
    DeadlineExceeded,
    LLMError,
    NoHealthyEndpoint,
    RetryBudgetExhausted,
    TransportError,
)

log = logging.getLogger(__name__)

DECISIONS_KEPT = 10_000
"""AIMD decisions kept for benchmarks and inspection; older ones are dropped."""

LOAD_ERRORS = (TransportError, NoHealthyEndpoint, DeadlineExceeded, RetryBudgetExhausted)
"""The failed calls that say the fleet is loaded (5xx, 429, timeouts, no replica, a deadline, the retry
budget spent), which the limit backs off from. A 4xx or an answer the schema refuses is the request's
fault: counted as an error, a few percent of bad answers cut the limit by 30% a window, and three idle
replicas served a sixth of the calls they could."""


class EndpointPool:
    def __init__(
        self,
        name: str,
        client: LLMClient,
        *,
        aimd: AimdSettings | None = None,
        per_replica_budget: int = 128,
        fixed_limit: int | None = None,
    ) -> None:
        """``fixed_limit`` turns adaptation off (the benchmark's saturating baseline)."""
        if (
            fixed_limit is not None and fixed_limit < 1
        ):  # 0 never lets a call start: the job would wait for ever
            raise ValueError(f"a fixed concurrency must be at least 1, not {fixed_limit}")
        self.name = name
        self.client = client
        self.per_replica_budget = per_replica_budget
        self.fixed_limit = fixed_limit
        self.controller = AimdController(aimd, budget=self.budget)
        self.in_flight = 0
        self.completed = 0
        self.failed = 0
        self.decisions: deque[tuple[float, int, str]] = deque(maxlen=DECISIONS_KEPT)
        self._latencies: list[float] = []
        self._window_failures = 0
        self._limited = False
        self._window_started = 0.0
        self._retries_seen = client.retries - client.failovers
        self._adapter = BackgroundLoop(f"aimd-{self.name}", self._adapt)
        self.changed = asyncio.Event()
        """Set whenever the limit moves (the dispatcher waits on it too)."""

    @property
    def replicas(self) -> int:
        return max(len(self.client.endpoints), 1)

    @property
    def budget(self) -> int:
        return self.per_replica_budget * self.replicas

    @property
    def limit(self) -> int:
        """Calls allowed in flight now; 0 while the pool holds no replica (all shifted to real-time),
        so work waits instead of failing its calls."""
        if not self.client.endpoints:
            return 0
        return self.fixed_limit if self.fixed_limit is not None else self.controller.limit

    @property
    def full(self) -> bool:
        return self.in_flight >= self.limit

    def call_started(self) -> None:
        """A call took one of the pool's slots (the dispatcher checks ``full`` first)."""
        self.in_flight += 1

    def call_finished(self) -> None:
        self.in_flight -= 1

    def mark_limited(self) -> None:
        """The dispatcher hit the limit: this window says something about the pool."""
        self._limited = True

    def observe(self, latency_s: float | None) -> None:
        """One finished call: its latency, or None when it failed for load (``LOAD_ERRORS``)."""
        if latency_s is None:
            self.failed += 1
            self._window_failures += 1
        else:
            self.completed += 1
            self._latencies.append(latency_s)

    def observe_failure(self, error: LLMError) -> None:
        """One call that failed: an error of the window when it says the fleet is loaded
        (``LOAD_ERRORS``), else only counted as failed."""
        if isinstance(error, LOAD_ERRORS):
            self.observe(None)
        else:
            self.failed += 1

    def start(self) -> None:
        if self.fixed_limit is None:
            self._adapter.start()

    async def stop(self) -> None:
        await self._adapter.stop()

    async def _adapt(self) -> None:
        loop = asyncio.get_running_loop()
        window = self.controller.settings.window_s
        self._window_started = loop.time()
        while True:
            await asyncio.sleep(window)
            now = loop.time()
            # failovers away from invalid answers are not a sign of load: see LOAD_ERRORS
            load_retries = self.client.retries - self.client.failovers
            retries = load_retries - self._retries_seen
            self._retries_seen = load_retries
            stats = WindowStats(
                completions=len(self._latencies),
                errors=self._window_failures + retries,
                duration_s=now - self._window_started,
                latency_s=statistics.median(self._latencies) if self._latencies else 0.0,
                limited=self._limited or self.full,
            )
            if stats.completions + stats.errors < self.controller.settings.min_samples and not stats.errors:
                continue  # keep accumulating: a short window is too noisy to judge
            before = self.controller.limit
            decision = self.controller.update(stats)
            self.decisions.append((now, decision.limit, decision.reason))
            if decision.limit != before:
                log.debug("pool %s: limit %d -> %d (%s)", self.name, before, decision.limit, decision.reason)
                self.changed.set()
            self._new_window(now)

    def _new_window(self, now: float) -> None:
        self._latencies, self._window_failures, self._limited, self._window_started = [], 0, False, now

    def set_endpoints(
        self, urls: Sequence[str], *, withdraw_after_s: float | Mapping[str, float] | None = None
    ) -> None:
        """Re-point the client at ``urls`` (capacity shifting) and rescale the limit. ``withdraw_after_s``:
        calls still running on a dropped replica that long from now move to a kept one (the hand-off)."""
        before = self.replicas
        self.client.set_endpoints(urls, withdraw_after_s=withdraw_after_s)
        self.controller.resize(self.budget, self.replicas / before)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing is being measured yet
            self._new_window(asyncio.get_running_loop().time())  # a window spanning the change misleads
        self.changed.set()
