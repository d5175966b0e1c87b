"""Never pay twice: calls with the same ``Idempotency-Key`` share one upstream request.

- While a call with a key is in flight, a second call with that key **joins** it: it gets the same
  answer (a stream from its first chunk), and the replicas see one request.
- A call's answer, once read to its end with a 2xx status and judged well formed by the gateway (the
  judgement that also tells the fleet the replica answered well: ``llm_client.forwarding.answer_problem``),
  is **kept** for ``ttl_s`` and a repeat of the key is answered from it without any upstream call. A
  broken 200 (an HTML page, an empty body, a stream with an ``error`` event) is not kept: a failover
  retry with the key calls again instead of getting the broken answer back for the whole TTL. Kept
  answers are held in memory, at most ``max_bytes`` of them counted with a fixed overhead each
  (``KEPT_ENTRY_OVERHEAD_BYTES``; the oldest go first), so the store is bounded in time and size; a
  gateway restart forgets them (the runner's own answer ledger in Redis is the durable record).
- A key sent again with another body (or path) is refused (422), as the IETF draft
  ``httpapi-idempotency-key-header`` asks: it is a caller's bug, and answering it with the other
  body's answer would be wrong.

The store is per gateway process: behind several processes on one port (``reuse_port``) a repeat
joins only when it lands on the same process.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import orjson

from gateway.flights import Flight, Head
from prompt_assembly.errors import ShopperError

IDEMPOTENCY_HEADER = "idempotency-key"

Found = Literal["joined", "reused"]

KEPT_ENTRY_OVERHEAD_BYTES = 2048
"""What a kept answer costs besides its body's bytes: the ``Flight`` (its ``asyncio.Event``, chunk list
and ``Head`` with the caller's headers), the ``_Kept`` record, the key, the digest and the ordered
dict's entry. Measured with ``tracemalloc`` (CPython 3.11.7, x86_64): 1,000 answers of 200 bytes, each
with the five answer headers the gateway writes and a 90-character key, tracked and kept as the gateway
keeps them, took 1,953 bytes each, 1,720 of them besides the body's ``bytes`` object; rounded up.
Counted on top of the body, an empty 2xx answer no longer costs nothing against ``max_bytes`` (then
only the TTL bounded how many tiny answers were kept)."""


class KeyReused(ShopperError):
    """The key was sent before with another request: answered 422."""


def request_digest(method: str, path: str, body: bytes | None, session: str = "") -> bytes:
    """What a key stands for: the same key must come with the same request. A JSON body is compared
    as its document (keys sorted, no spacing), so a restarted caller that serializes the same request
    differently still repeats it. ``session``: its session and version headers, as the gateway reads
    them; a repeat joins or reuses the call it repeats before the session check, so another session
    or version under the same key must not pass for a repeat (it would skip that check)."""
    digest = hashlib.sha256(f"{method} {path}\n{session}\n".encode())
    try:
        canonical = orjson.dumps(orjson.loads(body or b"null"), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = body or b""
    digest.update(canonical)
    return digest.digest()


@dataclass(slots=True)
class _Kept:
    digest: bytes
    flight: Flight
    expires: float
    cost: int
    """What it counts against ``max_bytes``: added when kept, the same taken off when dropped."""


def kept_cost(flight: Flight) -> int:
    """The bytes a kept answer counts against ``max_bytes``: its body and the entry around it."""
    return flight.size + KEPT_ENTRY_OVERHEAD_BYTES


class IdempotencyStore:
    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._flights: dict[str, tuple[bytes, Flight]] = {}
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.bytes_kept = 0
        self._closed = False

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    @property
    def kept(self) -> int:
        return len(self._kept)

    def find(self, key: str, digest: bytes) -> tuple[Found, Flight] | None:
        """The call ``key`` stands for: in flight (join it) or answered and kept (reuse it); None when
        there is none. Raises ``KeyReused`` when ``key`` came with another request."""
        self._expire()
        flying = self._flights.get(key)
        if flying is not None:
            if flying[0] != digest:
                raise KeyReused(f"Idempotency-Key {key!r} was sent before with another request")
            return "joined", flying[1]
        kept = self._kept.get(key)
        if kept is not None:
            if kept.digest != digest:
                raise KeyReused(f"Idempotency-Key {key!r} was sent before with another request")
            return "reused", kept.flight
        return None

    def track(self, key: str, digest: bytes, flight: Flight) -> None:
        """``flight`` is the call for ``key`` from now until it ends (``ended``)."""
        self._flights[key] = (digest, flight)

    def answered(self, key: str, flight: Flight) -> None:
        """``flight``'s call ended with an answer the gateway judged well formed (``answer_problem``,
        the same judgement the fleet is told): keep it for repeats of ``key`` when it is a whole 2xx
        answer that fits. The gateway calls this for no other answer, so a broken 200 is never kept."""
        flying = self._flights.get(key)
        if flying is None or flying[1] is not flight:
            return
        del self._flights[key]
        if self._closed:
            return  # the gateway stopped: nobody can ask for it again
        head = flight.head
        if not (flight.complete and isinstance(head, Head) and 200 <= head.status < 300):
            return  # an error or a broken answer: a repeat calls again
        cost = kept_cost(flight)
        if cost > self.max_bytes:
            return
        self._kept[key] = _Kept(flying[0], flight, self._clock() + self.ttl_s, cost)
        self.bytes_kept += cost
        while self.bytes_kept > self.max_bytes:
            self._drop_oldest()

    def ended(self, key: str, flight: Flight) -> None:
        """``flight``'s task is over, however it ended: ``key`` is no longer in flight. An answer worth
        keeping was kept as the call ended (``answered``); one not handed there is not kept."""
        flying = self._flights.get(key)
        if flying is not None and flying[1] is flight:
            del self._flights[key]

    def close(self) -> None:
        """Forget every kept answer, and keep none from now on: the gateway is stopping. Its handlers
        can outlive it (aiohttp keeps them in a module-level cache of built middleware chains), and
        through them this store; without this, up to ``max_bytes`` of answers nobody can ask for again
        stayed in memory. A call still ending (its request was being handled as the gateway stopped)
        keeps nothing."""
        self._closed = True
        self._kept.clear()
        self.bytes_kept = 0

    def _expire(self) -> None:
        now = self._clock()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, kept = self._kept.popitem(last=False)
        self.bytes_kept -= kept.cost
