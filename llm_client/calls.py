"""One call, however many attempts: deadline, backpressure, and the retry loop under the retry budget.

Guarantees:
- at most ``max_in_flight`` calls hold a slot; further callers wait (backpressure, not errors);
- the deadline covers the whole call, the wait for a slot included;
- a retryable failure is tried again on a *different* replica (the same one only when no other is
  routable), after a jittered backoff, and only while the retry budget has tokens, so an outage adds at
  most ``budget_ratio`` extra load;
- an attempt cut because its replica left the fleet (``Withdrawn``: a capacity hand-off) moves to
  another replica at once and counts as no attempt: the move was this side's choice, not a failure;
- an invalid answer is tried once more, not again: two replicas answering one prompt badly say more
  about the prompt than about the fleet. That one failover draws nothing from the retry budget: it is
  bounded by construction (one extra attempt per request, never a storm), and the budget is for
  outages. In a burst many calls are in flight to a replica that answers badly before its quarantine
  (``llm_client.answer_health``); with one bad replica of two, their failovers spent the budget and
  11-14% of a backlog's prompts became ``RetryBudgetExhausted`` error records;
- a server that refused with ``Retry-After`` (a gateway's 429 ``overloaded``, a 503) is not sent the
  retry before that time: when the retry can only go back to it (no other routable replica left
  untried), the wait is the longer of its ``Retry-After`` and the backoff; when that wait would end past
  the call's deadline, the call fails at once with the server's refusal instead of waiting for nothing
  (and spends no retry token). A retry that can go to another replica goes after the usual backoff:
  ``Retry-After`` speaks for the server that sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    InvalidAnswer,
    LLMError,
    Overloaded,
    RetryBudgetExhausted,
    Withdrawn,
)
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
        self.failovers = 0
        """Of ``retries``, those away from an invalid answer: a bad answer, not a sign of load."""
        self.withdrawn = 0
        """Calls moved to another replica because theirs left the fleet (``Withdrawn``): not retries."""

    @contextlib.asynccontextmanager
    async def call(self, deadline_s: float | None, tried: list[str]) -> AsyncIterator[float]:
        """One call: the deadline over the whole block (the wait for a slot included: a caller's
        deadline holds however long the queue), the backpressure gate, the in-flight count, and the
        attempt count (``len(tried)``) on whatever error leaves it. Yields when the deadline falls
        (event-loop time), for ``retried``."""
        deadline = deadline_s if deadline_s is not None else self.config.timeouts.deadline_s
        expires_at = asyncio.get_running_loop().time() + deadline
        try:
            async with asyncio.timeout(deadline), self._gate:
                self.in_flight += 1
                try:
                    yield expires_at
                finally:
                    self.in_flight -= 1
        except TimeoutError:
            # Built by a function, not held in a local: a local of this frame would be reachable from
            # the error's own traceback, a cycle that kept every caller's frame (the whole request)
            # for the cyclic collector instead of freeing it at once.
            raise _deadline_exceeded(deadline, len(tried)) from None
        except LLMError as exc:
            exc.attempts = len(tried)
            raise

    async def retried(
        self,
        route: RouteRequest,
        tried: list[str],
        attempt: Callable[[Endpoint, int], Awaitable[T]],
        expires_at: float | None = None,
    ) -> T:
        """Attempts in order, each ``attempt(endpoint, number)`` on the replica the policy picks;
        ``tried`` collects the replica of each (its length is the attempt count). A retryable error is
        retried under the retry budget with backoff (or the server's ``Retry-After``, within the
        deadline ``expires_at``, event-loop time); any other is raised at once."""
        self._budget.on_request()
        last_error: LLMError | None = None
        number = 0
        while True:
            moved = isinstance(last_error, Withdrawn)
            if moved:
                self.withdrawn += 1  # moved on at once: no attempt, backoff or retry token spent
            else:
                number += 1
            if number > self.config.retry.max_attempts or (
                isinstance(last_error, InvalidAnswer) and number > 2
            ):
                break  # raised below
            if number > 1 and not moved:
                wait_s = backoff_s(number - 2, self.config.retry, self._rng)
                told_s = self._retry_after(last_error, tried)
                if told_s is not None and last_error is not None:
                    left_s = None if expires_at is None else expires_at - asyncio.get_running_loop().time()
                    if left_s is not None and told_s >= left_s:
                        raise self._refused_past_deadline(last_error, told_s, left_s)
                    wait_s = max(wait_s, told_s)
                failover = isinstance(last_error, InvalidAnswer)  # away from a bad answer: see above
                if not failover and not self._budget.try_spend():
                    raise RetryBudgetExhausted(f"retry budget exhausted after: {last_error}") from last_error
                self.retries += 1
                self.failovers += failover
                await asyncio.sleep(wait_s)
            if not self.fleet.servable():
                await self.fleet.wait_for_routable()
            endpoint = self.fleet.choose(route, tried)
            tried.append(endpoint.name)
            try:
                return await attempt(endpoint, number)
            except LLMError as exc:
                if not exc.retryable:
                    raise
                # Kept without its traceback, which runs through this frame: held in a local of the
                # frame it names, the error would keep the frame, the route and the caller's frames
                # alive in a reference cycle, for the cyclic collector (as the deadline's error did).
                last_error = exc.with_traceback(None)
        assert last_error is not None
        try:
            raise last_error
        finally:
            del last_error  # raised from here, it names this frame again: not left in its locals

    def _retry_after(self, error: LLMError | None, tried: list[str]) -> float | None:
        """The wait ``error``'s server asked for, when the retry can only go back to a server already
        tried (no other routable replica is left untried); else None (the usual backoff)."""
        told_s = error.retry_after_s if isinstance(error, EndpointUnavailable) else None
        if told_s is None or any(e.routable and e.name not in tried for e in self.fleet.endpoints):
            return None
        return told_s

    @staticmethod
    def _refused_past_deadline(error: LLMError, told_s: float, left_s: float) -> EndpointUnavailable:
        """The refusal raised when the wait the server asked for outlasts the deadline: a load refusal
        (``Overloaded``) stays one, so nothing counts it against the server and a gateway answers it 429."""
        kind = Overloaded if isinstance(error, Overloaded) else EndpointUnavailable
        refused = kind(
            f"{error}; it asks for no retry before {told_s:g} s, past this call's deadline "
            f"({max(left_s, 0.0):.3f} s left)",
            retry_after_s=told_s,
        )
        refused.endpoint = error.endpoint
        return refused


def _deadline_exceeded(deadline_s: float, attempts: int) -> DeadlineExceeded:
    error = DeadlineExceeded(f"no answer within the {deadline_s:.3f} s deadline")
    error.attempts = attempts
    return error
