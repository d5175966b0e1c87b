"""A server that refuses with ``Retry-After`` (a gateway's 429 ``overloaded``, a 503) is not sent the retry
before that time, and a call whose deadline ends first fails at once with the refusal instead of waiting.

Each case runs real aiohttp servers, started here, that refuse the first requests and then answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web

from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.errors import EndpointUnavailable, Overloaded
from llm_client.status import retry_after_s

MESSAGES = [{"role": "user", "content": "Describe shopper s1."}]
ANSWER = orjson.dumps(
    {
        "model": "m",
        "choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }
)


@dataclass
class RefusingServer:
    """Answers 429 with ``retry_after`` to its first ``refusals`` completions, then 200."""

    refusals: int
    retry_after: str | None
    status: int = 429
    arrivals: list[float] = field(default_factory=list)
    url: str = ""

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrivals.append(asyncio.get_running_loop().time())
        if len(self.arrivals) <= self.refusals:
            headers = {} if self.retry_after is None else {"Retry-After": self.retry_after}
            return web.json_response({"error": {"type": "overloaded"}}, status=self.status, headers=headers)
        return web.Response(body=ANSWER, content_type="application/json")


async def healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def serving(server: RefusingServer) -> AsyncIterator[RefusingServer]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/health", healthy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        await runner.cleanup()


def config(*urls: str, deadline_s: float = 10.0) -> ClientConfig:
    return ClientConfig(
        endpoints=list(urls),
        policy="round_robin",
        stream=False,
        timeouts=Timeouts(connect_s=1, attempt_s=5, deadline_s=deadline_s),
        health=HealthSettings(interval_s=0.05, eject_after_failures=5),
        retry=RetrySettings(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02),
    )


@pytest.mark.parametrize("status", [429, 503])
async def test_the_retry_waits_for_the_servers_retry_after(status: int) -> None:
    """One gateway refuses with ``Retry-After: 1``: the retry comes no sooner (the client's own backoff,
    at most 20 ms here, used to send it at once), and the call gets the answer."""
    async with (
        serving(RefusingServer(refusals=1, retry_after="1", status=status)) as gateway,
        LLMClient(config(gateway.url)) as client,
    ):
        completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
    assert completion.text == "ok" and completion.attempts == 2
    first, second = gateway.arrivals
    assert second - first >= 1.0 - 0.01  # never before the server said (loop clock granularity)


async def test_a_retry_after_past_the_deadline_fails_at_once_with_the_refusal() -> None:
    """``Retry-After: 30`` with 2 s left: no retry that the server asked not to get, no wait for the
    deadline; the caller gets the refusal, saying why, after one request."""
    async with (
        serving(RefusingServer(refusals=5, retry_after="30")) as gateway,
        LLMClient(config(gateway.url)) as client,
    ):
        with pytest.raises(EndpointUnavailable) as caught:
            await client.chat(MESSAGES, routing_key="s1", max_tokens=5, deadline_s=2.0)
        retries = client.retries
    assert len(gateway.arrivals) == 1
    assert retries == 0
    assert caught.value.retry_after_s == 30
    assert "HTTP 429" in str(caught.value) and "deadline" in str(caught.value)
    assert caught.value.attempts == 1


async def test_the_retry_goes_to_another_replica_without_waiting() -> None:
    """``Retry-After`` speaks for the server that sent it: with another replica untried the retry goes
    there after the usual backoff, and the call does not wait out the refusing one's 30 s."""
    async with (
        serving(RefusingServer(refusals=5, retry_after="30")) as busy,
        serving(RefusingServer(refusals=0, retry_after=None)) as free,
        LLMClient(config(busy.url, free.url, deadline_s=5.0)) as client,
    ):
        completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
    assert len(busy.arrivals) == 1 and len(free.arrivals) == 1
    assert completion.attempts == 2 and free.url.endswith(completion.endpoint)


async def test_without_retry_after_the_clients_own_backoff_applies() -> None:
    async with (
        serving(RefusingServer(refusals=1, retry_after=None)) as gateway,
        LLMClient(config(gateway.url)) as client,
    ):
        completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
    assert completion.attempts == 2 and len(gateway.arrivals) == 2


def test_retry_after_forms() -> None:
    """RFC 9110: seconds or an HTTP date; anything unreadable is ignored (the backoff applies)."""
    now = 1_800_000_000.0
    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 0 ") == 0.0
    assert retry_after_s("1.5") == 1.5
    assert retry_after_s(email.utils.formatdate(now + 120, usegmt=True), now=now) == pytest.approx(120)
    assert retry_after_s(email.utils.formatdate(now - 120, usegmt=True), now=now) == 0.0
    huge_year = "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"  # raised OverflowError: a 500 in real time
    huge_offset = "Mon, 01 Jan 2026 00:00:00 +99999999"
    for unreadable in (None, "", "soon", "-5", "nan", "inf", "Mon, 99 Foo 2026", huge_year, huge_offset):
        assert retry_after_s(unreadable) is None, unreadable


async def test_refusals_for_load_never_eject_the_server() -> None:
    """A lone gateway sheds load with more 429s in a row than ``eject_after_failures``: they are
    refusals, not failures (``Fleet.refused``), so it stays routable and answers the next call. Counted
    as failures, two 429s ejected it, and every caller waited for its ``/health``."""
    strict = HealthSettings(interval_s=0.05, eject_after_failures=2)
    async with (
        serving(RefusingServer(refusals=4, retry_after="0")) as gateway,
        LLMClient(config(gateway.url).model_copy(update={"health": strict})) as client,
    ):
        with pytest.raises(Overloaded):
            await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
        (endpoint,) = client.endpoints
        assert (endpoint.refused, endpoint.failed, endpoint.ejections) == (3, 0, 0)
        assert endpoint.routable
        completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
    assert completion.attempts == 2 and len(gateway.arrivals) == 5


async def test_a_5xx_still_counts_against_the_server() -> None:
    """Only a 429 is a refusal: a 503 is the server failing, and two in a row eject it."""
    strict = HealthSettings(interval_s=60, eject_after_failures=2)
    async with (
        serving(RefusingServer(refusals=2, retry_after=None, status=503)) as broken,
        serving(RefusingServer(refusals=0, retry_after=None)) as spare,
        LLMClient(config(broken.url, spare.url).model_copy(update={"health": strict})) as client,
    ):
        for _ in range(2):
            await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
        failing = next(e for e in client.endpoints if broken.url.endswith(e.name))
        assert (failing.failed, failing.refused, failing.ejections) == (2, 0, 1)
        assert not failing.routable
