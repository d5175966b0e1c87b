"""The idempotency store's bounds, on its own (no HTTP): kept answers expire after the TTL and take at
most ``max_bytes`` (each counted with its entry's overhead), errors and broken answers are not kept, and
a key comes with one request only. The clock is the store's own parameter, so expiry is checked without
waiting. Whether a 2xx answer is well formed is the gateway's judgement (``answer_problem``), tested
over HTTP in ``test_kept_answers.py``: the store keeps what it is handed by ``answered``."""

from __future__ import annotations

import pytest

from gateway.flights import Flight, GatewayAnswer, Head
from gateway.idempotency import KEPT_ENTRY_OVERHEAD_BYTES, IdempotencyStore, KeyReused, request_digest

DIGEST = request_digest("POST", "/v1/chat/completions", b'{"model": "m", "messages": []}')
ROOM = 100 * KEPT_ENTRY_OVERHEAD_BYTES
"""A ``max_bytes`` no test's few small answers reach."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def answered(body: bytes, status: int = 200) -> Flight:
    flight = Flight(keep_running=True)
    flight.answer_head(Head(status, {"content-type": "application/json"}, streaming=False))
    flight.append(body)
    flight.end(complete=True)
    return flight


def keep(store: IdempotencyStore, key: str, flight: Flight) -> None:
    """As the gateway keeps a well-formed answer: tracked while in flight, handed over when it ended."""
    store.track(key, DIGEST, flight)
    store.answered(key, flight)
    store.ended(key, flight)


def test_a_kept_answer_is_reused_until_its_ttl_passes() -> None:
    clock = Clock()
    store = IdempotencyStore(ttl_s=60, max_bytes=ROOM, clock=clock)
    flight = Flight(keep_running=True)
    store.track("k", DIGEST, flight)
    assert store.find("k", DIGEST) == ("joined", flight)
    flight.answer_head(Head(200, {}, streaming=False))
    flight.append(b"{}")
    flight.end(complete=True)
    store.answered("k", flight)
    store.ended("k", flight)
    assert store.find("k", DIGEST) == ("reused", flight)
    clock.now = 60
    assert store.find("k", DIGEST) is None
    assert (store.kept, store.bytes_kept) == (0, 0)


def test_kept_answers_stay_within_max_bytes_oldest_first() -> None:
    entry = KEPT_ENTRY_OVERHEAD_BYTES + 4
    store = IdempotencyStore(ttl_s=60, max_bytes=2 * entry + 2, clock=Clock())
    for key in ("a", "b", "c"):
        keep(store, key, answered(b"x" * 4))
    assert store.find("a", DIGEST) is None  # three entries are over: the oldest went
    assert store.find("b", DIGEST) is not None and store.find("c", DIGEST) is not None
    assert store.bytes_kept == 2 * entry
    keep(store, "d", answered(b"x" * (store.max_bytes - KEPT_ENTRY_OVERHEAD_BYTES + 1)))
    assert store.find("d", DIGEST) is None and store.bytes_kept == 2 * entry  # too big alone


def test_many_tiny_answers_are_bounded_by_max_bytes() -> None:
    """Only an answer's body was counted: an empty 2xx answer cost nothing, so any number of them (each
    a ``Flight``, its event, headers, key and digest: about 2 KB) was kept for the whole TTL."""
    clock = Clock()
    store = IdempotencyStore(ttl_s=600, max_bytes=64 * 1024, clock=clock)
    for i in range(1000):
        keep(store, f"job:shopper:{i}", answered(b""))
    assert store.kept <= store.max_bytes // KEPT_ENTRY_OVERHEAD_BYTES
    assert 0 < store.bytes_kept <= store.max_bytes
    assert store.find("job:shopper:999", DIGEST) is not None, "the newest stay, the oldest went"
    clock.now = 600  # all expire: dropping takes off exactly what keeping added
    assert store.find("job:shopper:999", DIGEST) is None
    assert (store.kept, store.bytes_kept) == (0, 0)


def test_errors_and_broken_answers_are_not_kept() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=ROOM, clock=Clock())
    refused = Flight(keep_running=True)
    refused.end(answer=GatewayAnswer(429, "overloaded", "busy"))
    bad = answered(b"{}", status=400)
    broken = Flight(keep_running=True)
    broken.answer_head(Head(200, {}, streaming=True))
    broken.append(b"data: {}\n\n")
    broken.end()
    for key, flight in (("refused", refused), ("bad", bad), ("broken", broken)):
        keep(store, key, flight)
        assert store.find(key, DIGEST) is None  # a repeat calls again
    judged_broken = answered(b"<html>502 Bad Gateway</html>")  # a 200 the gateway judged no answer
    store.track("judged", DIGEST, judged_broken)
    store.ended("judged", judged_broken)  # ended without ``answered``
    assert store.find("judged", DIGEST) is None and store.in_flight == 0


def test_a_key_stands_for_one_request() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=ROOM, clock=Clock())
    store.track("k", DIGEST, Flight(keep_running=True))
    with pytest.raises(KeyReused):
        store.find("k", request_digest("POST", "/v1/chat/completions", b'{"model": "other"}'))
    # The same document serialized otherwise is the same request.
    same = request_digest("POST", "/v1/chat/completions", b'{"messages":[],"model":"m"}')
    assert store.find("k", same) is not None


def test_a_closed_store_forgets_its_answers_and_keeps_no_more() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=ROOM)
    before, ending = answered(b'{"a": 1}'), answered(b'{"b": 2}')
    keep(store, "before", before)
    store.track("ending", DIGEST, ending)  # its request was being handled as the gateway stopped
    store.close()
    store.answered("ending", ending)
    store.ended("ending", ending)
    assert (store.kept, store.bytes_kept, store.in_flight) == (0, 0, 0)
    assert store.find("before", DIGEST) is None and store.find("ending", DIGEST) is None
