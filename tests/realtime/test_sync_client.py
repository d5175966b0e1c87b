"""The blocking client's one retry, against a socket server standing in for a service that dies: a
request dropped on a new connection (the service died under it) is not sent again, so the caller hears
``MatchUnavailable`` within deadline + slack, not a second full wait later; a kept-alive connection the
server had closed between requests is reopened once."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import pytest

from realtime.client import MatchUnavailable, SyncMatchClient

ANSWER = orjson.dumps(
    {
        "shopper_id": "s1",
        "ranked": [{"product_id": "a", "rank": 1, "score": 1.0, "reason": "r", "source": "fallback"}],
        "degraded": True,
        "degraded_reason": "deadline",
        "model": None,
        "llm_ms": None,
        "elapsed_ms": 1.0,
        "deadline_ms": 250,
        "signals": {"shopper": False, "products": 0},
    }
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER
)


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


@contextmanager
def serving(script: Callable[[socket.socket], None]) -> Iterator[str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    thread = threading.Thread(target=script, args=(server,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        thread.join(5)


def test_a_request_dropped_on_a_new_connection_is_not_sent_again() -> None:
    def dies_under_the_request(server: socket.socket) -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        time.sleep(0.2)
        reset(conn)  # the service died mid-request
        server.settimeout(2)
        try:  # a resend would land here, and be answered after another full wait
            again, _ = server.accept()
            again.recv(65536)
            time.sleep(0.2)
            again.sendall(RESPONSE)
            again.close()
        except OSError:
            pass

    with serving(dies_under_the_request) as url, SyncMatchClient(url) as client:
        started = time.monotonic()
        with pytest.raises(MatchUnavailable, match="dropped"):
            client.match("s1", "", ["a"], deadline_ms=250)
        assert time.monotonic() - started < 0.3 + 0.1


def test_a_kept_alive_connection_the_server_closed_is_reopened_once() -> None:
    def closes_between_requests(server: socket.socket) -> None:
        for _ in range(2):
            conn, _ = server.accept()
            conn.recv(65536)
            conn.sendall(RESPONSE)
            time.sleep(0.1)
            conn.close()  # an idle keep-alive connection, closed by the server

    with serving(closes_between_requests) as url, SyncMatchClient(url) as client:
        assert client.match("s1", "", ["a"], deadline_ms=250).ranked[0].product_id == "a"
        time.sleep(0.3)
        assert client.match("s1", "", ["a"], deadline_ms=250).ranked[0].product_id == "a"
