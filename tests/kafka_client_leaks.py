"""A test that leaves a Kafka client running fails.

A librdkafka client (producer, consumer, admin client) that its owner dropped without closing lives
on until the collector frees it, with its threads and broker connections: it went on dialling a
broker that had stopped, which is how every CI run came to end with librdkafka's "Connection refused"
lines, and how a failed runner run came to hold its producers open (``docs/reliability.md``, "What
the suite found"). Each librdkafka client runs one ``rdk:main`` thread, so this counts the test
process's ``rdk:main`` threads before and after each test. A client still running after the test's
own fixtures closed theirs, a collection and ``GRACE_S``, fails the test at teardown.

Where ``/proc`` does not tell (not Linux), nothing is checked. Clients of a fixture wider than a test
(a module's, the session's) are made before the count and closed after it, so they do not count.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CLIENT_THREAD = "rdk:main"
"""The name librdkafka gives each client's main thread."""

GRACE_S = 2.0
"""How long a client dropped at the test's end may take to go: librdkafka destroys a client on its
own threads, after the last reference is gone."""

TASKS = Path("/proc/self/task")


def running_clients() -> int | None:
    """The librdkafka clients of this process (its ``rdk:main`` threads); None without ``/proc``."""
    if not TASKS.is_dir():
        return None
    count = 0
    for comm in TASKS.glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        count += name == CLIENT_THREAD
    return count


def clients_left(before: int) -> int:
    """How many more clients run than ``before``, once dropped ones were collected and given
    ``GRACE_S`` to stop."""
    deadline = time.monotonic() + GRACE_S
    while True:
        now = running_clients() or 0
        if now <= before:
            return 0
        gc.collect()
        if time.monotonic() >= deadline:
            return now - before
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_kafka_client_left() -> Iterator[None]:
    """Fails a test that leaves a Kafka client running (see the module's docstring)."""
    before = running_clients()
    yield
    if before is None:
        return
    left = clients_left(before)
    if left:
        pytest.fail(
            f"{left} Kafka client(s) left running by this test ({CLIENT_THREAD} threads: {before} before): "
            "close each producer, consumer and admin client it makes, also when it fails",
            pytrace=False,
        )
