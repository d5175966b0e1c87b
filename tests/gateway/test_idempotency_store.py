"""The idempotency store's bounds, on its own (no HTTP): kept answers expire after the TTL and take at
most ``max_bytes``, errors and broken answers are not kept, and a key comes with one request only.
The clock is the store's own parameter, so expiry is checked without waiting."""

from __future__ import annotations

import pytest

from gateway.flights import Flight, GatewayAnswer, Head
from gateway.idempotency import IdempotencyStore, KeyReused, request_digest

DIGEST = request_digest("POST", "/v1/chat/completions", b'{"model": "m", "messages": []}')


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


def test_a_kept_answer_is_reused_until_its_ttl_passes() -> None:
    clock = Clock()
    store = IdempotencyStore(ttl_s=60, max_bytes=1024, clock=clock)
    flight = Flight(keep_running=True)
    store.track("k", DIGEST, flight)
    assert store.find("k", DIGEST) == ("joined", flight)
    flight.answer_head(Head(200, {}, streaming=False))
    flight.append(b"{}")
    flight.end(complete=True)
    store.ended("k", flight)
    assert store.find("k", DIGEST) == ("reused", flight)
    clock.now = 60
    assert store.find("k", DIGEST) is None
    assert (store.kept, store.bytes_kept) == (0, 0)


def test_kept_answers_stay_within_max_bytes_oldest_first() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=10, clock=Clock())
    for key in ("a", "b", "c"):
        flight = answered(b"x" * 4)
        store.track(key, DIGEST, flight)
        store.ended(key, flight)
    assert store.find("a", DIGEST) is None  # 12 bytes > 10: the oldest went
    assert store.find("b", DIGEST) is not None and store.find("c", DIGEST) is not None
    assert store.bytes_kept == 8
    too_big = answered(b"x" * 11)
    store.track("d", DIGEST, too_big)
    store.ended("d", too_big)
    assert store.find("d", DIGEST) is None and store.bytes_kept == 8


def test_errors_and_broken_answers_are_not_kept() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=1024, clock=Clock())
    refused = Flight(keep_running=True)
    refused.end(answer=GatewayAnswer(429, "overloaded", "busy"))
    bad = answered(b"{}", status=400)
    broken = Flight(keep_running=True)
    broken.answer_head(Head(200, {}, streaming=True))
    broken.append(b"data: {}\n\n")
    broken.end()
    for key, flight in (("refused", refused), ("bad", bad), ("broken", broken)):
        store.track(key, DIGEST, flight)
        store.ended(key, flight)
        assert store.find(key, DIGEST) is None  # a repeat calls again


def test_a_key_stands_for_one_request() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=1024, clock=Clock())
    store.track("k", DIGEST, Flight(keep_running=True))
    with pytest.raises(KeyReused):
        store.find("k", request_digest("POST", "/v1/chat/completions", b'{"model": "other"}'))
    # The same document serialized otherwise is the same request.
    same = request_digest("POST", "/v1/chat/completions", b'{"messages":[],"model":"m"}')
    assert store.find("k", same) is not None


def test_a_closed_store_forgets_its_answers_and_keeps_no_more() -> None:
    store = IdempotencyStore(ttl_s=60, max_bytes=1024)
    before, ending = answered(b'{"a": 1}'), answered(b'{"b": 2}')
    store.track("before", DIGEST, before)
    store.ended("before", before)
    store.track("ending", DIGEST, ending)  # its request was being handled as the gateway stopped
    store.close()
    store.ended("ending", ending)
    assert (store.kept, store.bytes_kept, store.in_flight) == (0, 0, 0)
    assert store.find("before", DIGEST) is None and store.find("ending", DIGEST) is None
