"""Which attempts are likely still *queued* on a replica: routed there, not yet admitted into an iteration.

An engine reuses only KV blocks it has computed, and admits waiting requests at iteration boundaries.
Two prompts of one key that wait in a replica's queue together (the second extending the first) are
admitted into one iteration: the second finds nothing of the first cached, both compute the shared part,
and both first tokens wait for both prefills. ``prefix_aware`` asks this tracker whether a key has
attempts likely still queued on a replica, and if so believes a new prompt of that key finds there only
what those attempts found.

What the router can tell without seeing the engine:

- an attempt routed to a replica that ran nothing is admitted at once;
- one routed while the replica ran only decode steps waits for the current step to end: it counts as
  queued for ``window_s`` (about one decode iteration);
- one routed while a prefill ran there waits for that iteration to end, which the replica marks by
  sending a first token: it counts as queued until some attempt there reports its prefill done.

Pure bookkeeping, no I/O, one event loop; the clock is injected for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(slots=True)
class _Replica:
    prefilling: int = 0
    """Attempts routed here whose prefill is neither done nor failed."""
    first_tokens: int = 0
    """Prefills reported done here: each marks the end of an iteration."""


@dataclass(frozen=True, slots=True)
class _Attempt:
    attempt: object
    """The caller's handle of the attempt (its ``RouteRequest``: one attempt per request and replica)."""
    found: int
    """Tokens it was believed to find cached (its own blocks not counted)."""
    routed_at: float
    replica_busy: bool
    """The replica had requests in flight when it was routed (else it is admitted at once)."""
    behind_prefill: bool
    """A prefill was under way there when it was routed."""
    first_tokens_then: int


class QueuedPrefills:
    """Each key's attempts on each replica until their prefill is over, and per replica the prefills
    under way and the first tokens seen."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._attempts: dict[tuple[str, str], list[_Attempt]] = {}

    def routed(self, key: str, replica: str, attempt: object, *, found: int, replica_busy: bool) -> None:
        """``attempt`` of ``key`` was sent to ``replica``, believed to find ``found`` tokens cached."""
        state = self._replica(replica)
        self._attempts.setdefault((key, replica), []).append(
            _Attempt(attempt, found, self._clock(), replica_busy, state.prefilling > 0, state.first_tokens)
        )
        state.prefilling += 1

    def finished(self, key: str, replica: str, attempt: object, *, computed: bool) -> None:
        """``attempt``'s prefill is over: computed (its first token came, an iteration ended) or not (it
        failed). Call once per attempt."""
        state = self._replica(replica)
        state.prefilling = max(0, state.prefilling - 1)
        if computed:
            state.first_tokens += 1
        attempts = self._attempts.get((key, replica))
        if attempts is not None:
            attempts[:] = [a for a in attempts if a.attempt is not attempt]
            if not attempts:
                del self._attempts[(key, replica)]

    def pending(self, key: str, replica: str) -> bool:
        """Whether ``key`` has an attempt on ``replica`` whose prefill is not over."""
        return (key, replica) in self._attempts

    def queued_found(self, key: str, replica: str) -> int | None:
        """What ``key``'s attempts likely still queued on ``replica`` were believed to find (the least of
        them: a new prompt sent there joins their iteration and reuses no more); None if none is, or
        if the rule is off (``window_s`` 0)."""
        attempts = self._attempts.get((key, replica))
        if not attempts or self.window_s <= 0:
            return None
        now, first_tokens = self._clock(), self._replica(replica).first_tokens
        found = [
            a.found
            for a in attempts
            if (a.replica_busy and now - a.routed_at < self.window_s)
            or (a.behind_prefill and first_tokens == a.first_tokens_then)
        ]
        return min(found) if found else None

    def forget(self, replica: str) -> None:
        """The replica's cache was lost: no attempt there is believed to find anything any more. The
        attempts and counters stay: those under way there still finish (or fail) and are counted out."""
        for (_, name), attempts in self._attempts.items():
            if name == replica:
                attempts[:] = [replace(a, found=0) for a in attempts]

    def first_tokens(self, replica: str) -> int:
        """Prefills reported done on ``replica`` (iteration ends seen there)."""
        return self._replica(replica).first_tokens

    def __len__(self) -> int:
        """Attempts tracked (their prefill not over)."""
        return sum(len(attempts) for attempts in self._attempts.values())

    def _replica(self, name: str) -> _Replica:
        state = self._replicas.get(name)
        if state is None:
            state = self._replicas[name] = _Replica()
        return state
