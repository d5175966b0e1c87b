"""One call, however many attempts: deadline, backpressure, and the retry loop under the retry budget.

Guarantees:
- at most ``max_in_flight`` calls hold a slot; further callers wait (backpressure, not errors);
- the deadline covers the whole call, the wait for a slot included;
- a retryable failure is tried again on a *different* replica (the same one only when no other is
  routable), after a jittered backoff, and only while the retry budget has tokens, so an outage adds at
  most ``budget_ratio`` extra load;
- an invalid answer is tried once more, not again: two replicas answering one prompt badly say more
  about the prompt than about the fleet. That one failover draws nothing from the retry budget: it is
  bounded by construction (one extra attempt per request, never a storm), and the budget is for
  outages. In a burst many calls are in flight to a replica that answers badly before its quarantine
  (``llm_client.answer_health``); with one bad replica of two, their failovers spent the budget and
  11-14% of a backlog's prompts became ``RetryBudgetExhausted`` error records.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.errors import DeadlineExceeded, InvalidAnswer, LLMError, RetryBudgetExhausted
from llm_client.fleet import Fleet
from llm_client.retry import RetryBudget, backoff_s
from llm_client.routing import RouteRequest

T = TypeVar("T")


class Calls:
    """The slots, the retry budget, and the counters ``/metrics`` reads (``in_flight``, ``retries``)."""

    def __init__(self, config: ClientConfig, fleet: Fleet, *, seed: int = 0) -> None:
        self.config = config
        self.fleet = fleet
        self._gate = asyncio.Semaphore(config.max_in_flight)
        self._budget = RetryBudget(config.retry)
        self._rng = random.Random(seed)
        self.in_flight = 0
        self.retries = 0

    @contextlib.asynccontextmanager
    async def call(self, deadline_s: float | None, tried: list[str]) -> AsyncIterator[None]:
        """One call: the deadline over the whole block (the wait for a slot included: a caller's
        deadline holds however long the queue), the backpressure gate, the in-flight count, and the
        attempt count (``len(tried)``) on whatever error leaves it."""
        deadline = deadline_s if deadline_s is not None else self.config.timeouts.deadline_s
        try:
            async with asyncio.timeout(deadline), self._gate:
                self.in_flight += 1
                try:
                    yield
                finally:
                    self.in_flight -= 1
        except TimeoutError:
            error = DeadlineExceeded(f"no answer within the {deadline:.3f} s deadline")
            error.attempts = len(tried)
            raise error from None
        except LLMError as exc:
            exc.attempts = len(tried)
            raise

    async def retried(
        self,
        route: RouteRequest,
        tried: list[str],
        attempt: Callable[[Endpoint, int], Awaitable[T]],
    ) -> T:
        """Attempts in order, each ``attempt(endpoint, number)`` on the replica the policy picks;
        ``tried`` collects the replica of each (its length is the attempt count). A retryable error is
        retried under the retry budget with backoff; any other is raised at once."""
        self._budget.on_request()
        last_error: LLMError | None = None
        for number in range(1, self.config.retry.max_attempts + 1):
            if isinstance(last_error, InvalidAnswer) and number > 2:
                raise last_error
            if number > 1:
                failover = isinstance(last_error, InvalidAnswer)  # away from a bad answer: see above
                if not failover and not self._budget.try_spend():
                    raise RetryBudgetExhausted(f"retry budget exhausted after: {last_error}")
                self.retries += 1
                await asyncio.sleep(backoff_s(number - 2, self.config.retry, self._rng))
            if not any(e.routable for e in self.fleet.endpoints):
                await self.fleet.wait_for_routable()
            endpoint = self.fleet.choose(route, tried)
            tried.append(endpoint.name)
            try:
                return await attempt(endpoint, number)
            except LLMError as exc:
                if not exc.retryable:
                    raise
                last_error = exc
        assert last_error is not None
        raise last_error
