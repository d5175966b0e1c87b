"""The serving side is untrusted input: every bad answer a replica can send becomes an ``LLMError``, is
tried once more elsewhere, and a replica that keeps sending them is quarantined until a probe passes.

Each case runs a real simulator replica with the ``bad_answer`` fault beside healthy ones, over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from llm_client import ClientConfig, LLMClient
from llm_client.answer_health import AnswerHealthSettings
from llm_client.answers import AnswerLimits
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.errors import AnswerTooLarge, DeadlineExceeded, InvalidAnswer, LLMError
from llm_client.passthrough import UsageTap
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from llm_client.routing.session_affinity import rendezvous_order
from pipeline.enrichment import Enricher, parse_understanding
from prompt_assembly.errors import ConfigurationError
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import EnrichmentError, PromptRequest, ShopperInsight
from serving.simulator.bad_answers import BAD_ANSWERS, BadAnswer
from serving.simulator.testing import running_simulator
from tests.helpers import serving
from tests.prompt_assembly.test_sessions import event

MESSAGES = [{"role": "user", "content": "Describe shopper s1: viewed hats, added a witch hat to the cart."}]


def prompt_of(shopper: str) -> PromptRequest:
    """A cart-add prompt of its own for ``shopper`` (distinct prompts spread over the replicas)."""
    processor = SessionProcessor()
    session = processor.new_session(shopper)
    processor.apply(session, event("view", 100, shopper=shopper))
    return processor.apply(session, event("add_to_cart", 101, shopper=shopper)).prompts[0]


def config(*urls: str, **overrides: object) -> ClientConfig:
    options: dict[str, object] = {
        "endpoints": list(urls),
        "policy": "prefix_aware",
        "timeouts": Timeouts(connect_s=1, attempt_s=5, deadline_s=10),
        "health": HealthSettings(interval_s=0.05),
        "retry": RetrySettings(backoff_base_s=0.01),
        "answer_health": AnswerHealthSettings(cooldown_s=0.2),
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
@pytest.mark.parametrize("kind", [k for k in BAD_ANSWERS if k != "not_understanding"])
async def test_every_bad_answer_is_an_llm_error(kind: BadAnswer, stream: bool) -> None:
    """Alone, a bad replica's answer is a typed error (it used to be LineTooLong, TypeError or a
    KeyError-turned-unavailable); nothing else leaves the client."""
    async with (
        running_simulator(time_scale=0.01, bad_answer=kind) as bad,
        LLMClient(config(bad.url, stream=stream)) as client,
    ):
        with pytest.raises(InvalidAnswer) as caught:
            await client.chat(MESSAGES, routing_key="s1", max_tokens=20)
    assert caught.value.endpoint is not None and bad.url.endswith(caught.value.endpoint)
    if kind == "huge":
        assert isinstance(caught.value, AnswerTooLarge)


async def test_an_answer_over_the_limit_is_refused_before_it_is_read_whole() -> None:
    async with (
        running_simulator(time_scale=0.01, bad_answer="huge") as bad,
        LLMClient(config(bad.url, answer_limits={"max_answer_bytes": 64 * 1024})) as client,
    ):
        with pytest.raises(AnswerTooLarge, match="65536-byte limit"):
            await client.chat(MESSAGES, routing_key="s1", max_tokens=20)


@pytest.mark.parametrize("kind", BAD_ANSWERS)
async def test_a_bad_answer_is_tried_on_another_replica_and_the_bad_replica_is_quarantined(
    kind: BadAnswer, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad replica beside a healthy one: every prompt still gets an insight (one more attempt
    elsewhere), and the bad replica is out of routing after a few answers, with its reason."""
    caplog.set_level(logging.WARNING, logger="llm_client")
    async with (
        running_simulator(time_scale=0.01, bad_answer=kind) as bad,
        running_simulator(time_scale=0.01) as good,
        # session affinity: the worst case, it sends a shopper back to the replica that failed it
        LLMClient(config(bad.url, good.url, policy="session_affinity")) as client,
    ):
        enricher = Enricher(client)
        results = [await enricher.enrich(prompt_of(f"shopper-{i}")) for i in range(30)]
        endpoint = client.endpoints[0]
    assert all(isinstance(r, ShopperInsight) for r in results), [
        r for r in results if not isinstance(r, ShopperInsight)
    ]
    assert endpoint.quarantined and not endpoint.routable
    expected = "schema" if kind == "not_understanding" else None
    assert endpoint.out_reason is not None and (expected or "") in endpoint.out_reason
    assert sum(endpoint.invalid_answers.values()) >= 3
    assert any("quarantining replica" in r.getMessage() for r in caplog.records)
    assert sum(isinstance(r, ShopperInsight) and r.attempts == 2 for r in results) >= 3


async def test_a_quarantined_replica_comes_back_through_a_probe_once_it_answers_well(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While it still answers badly, it is probed once per cool-down (a failed probe starts another),
    not at every health check; once it answers well, a probe re-admits it."""
    caplog.set_level(logging.WARNING, logger="llm_client")
    settings = AnswerHealthSettings(cooldown_s=0.2)
    async with (
        running_simulator(time_scale=0.01, bad_answer="wrong_types") as flaky,
        running_simulator(time_scale=0.01) as good,
        LLMClient(config(flaky.url, good.url, policy="round_robin", answer_health=settings)) as client,
    ):
        endpoint = client.endpoints[0]
        for i in range(20):
            await client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=20)
        assert endpoint.quarantined
        await asyncio.sleep(0.6)  # cool-downs pass, probes keep failing: the replica still answers badly
        assert endpoint.quarantined and client.answer_health.readmissions == 0
        records = list(caplog.records)
        quarantined_s = time.time() - next(
            r.created for r in records if r.getMessage().startswith("quarantining replica")
        )
        failed_probes = sum("stays quarantined: probe failed" in r.getMessage() for r in records)
        # once per cool-down since the quarantine, not at every health check (each 0.05 s: 3-4 times more)
        assert 1 <= failed_probes <= quarantined_s / settings.cooldown_s + 1, (failed_probes, quarantined_s)
        flaky.replica.bad_answer = "none"
        async with asyncio.timeout(5):
            while endpoint.quarantined:
                await asyncio.sleep(0.05)
        assert client.answer_health.readmissions == 1 and endpoint.routable


async def test_the_last_routable_replica_is_never_quarantined() -> None:
    async with (
        running_simulator(time_scale=0.01, bad_answer="not_json") as bad,
        LLMClient(config(bad.url)) as client,
    ):
        for i in range(10):
            with pytest.raises(InvalidAnswer):
                await client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=20)
        assert client.endpoints[0].routable


async def test_an_invalid_answer_is_tried_once_more_not_until_the_attempts_run_out() -> None:
    async with (
        running_simulator(time_scale=0.01, bad_answer="not_understanding") as a,
        running_simulator(time_scale=0.01, bad_answer="not_understanding") as b,
        running_simulator(time_scale=0.01, bad_answer="not_understanding") as c,
        LLMClient(config(a.url, b.url, c.url, retry=RetrySettings(max_attempts=3))) as client,
    ):
        with pytest.raises(InvalidAnswer) as caught:
            await client.chat(MESSAGES, routing_key="s1", max_tokens=20, validate=parse_understanding)
    assert caught.value.attempts == 2 and caught.value.raw


@contextlib.asynccontextmanager
async def stalling_replica() -> AsyncIterator[str]:
    """A replica that takes 5 s to answer anything."""

    async def stall(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"choices": [{"message": {"content": "late"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stall)
    async with serving(app) as url:
        yield url


async def test_the_deadline_covers_the_wait_for_a_concurrency_slot() -> None:
    """With every slot taken, a caller's deadline still holds: it used to start only once a slot was
    free, so the second call below waited for the first one's 5 s."""
    async with stalling_replica() as url, LLMClient(config(url, max_in_flight=1, stream=False)) as client:
        holder = asyncio.create_task(client.chat(MESSAGES, routing_key="a", max_tokens=5, deadline_s=10))
        await asyncio.sleep(0.1)
        with pytest.raises(DeadlineExceeded):
            await client.chat(MESSAGES, routing_key="b", max_tokens=5, deadline_s=0.3)
        assert not holder.done(), "the second call should have given up while the first held the slot"
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError, LLMError):
            await holder


@pytest.mark.parametrize("endpoints", [[], ["127.0.0.1:8000"]], ids=["empty", "no-scheme"])
def test_an_unusable_endpoint_list_fails_when_the_settings_are_read(endpoints: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        ClientConfig(endpoints=endpoints)
    assert "endpoints" in str(caught.value)
    assert isinstance(caught.value.__cause__ or caught.value, ValueError)
    with pytest.raises(ConfigurationError):
        ClientConfig._some_endpoints(endpoints)


def test_the_default_policy_is_the_measured_best() -> None:
    assert ClientConfig(endpoints=["http://127.0.0.1:1"]).policy == "prefix_aware"


async def test_attempts_cancelled_by_their_deadline_leave_no_per_key_state() -> None:
    """The gateway makes a new anonymous key per request: an attempt its caller's deadline cancelled was
    never observed, so prefix_aware's per-key in-flight map kept an entry per such key for good."""
    async with stalling_replica() as url, LLMClient(config(url, stream=False)) as client:
        for i in range(20):
            with pytest.raises(DeadlineExceeded):
                await client.chat(MESSAGES, routing_key=f"anonymous-{i}", max_tokens=5, deadline_s=0.05)
        policy = client.policy
        assert isinstance(policy, PrefixAwarePolicy)
        assert policy._key_inflight == {}
        assert client.endpoints[0].outstanding == 0


@contextlib.asynccontextmanager
async def one_write_stream(payload: bytes) -> AsyncIterator[str]:
    """A replica that streams ``payload`` in one write (so one read of the client gets all of it)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(payload)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serving(app) as url:
        yield url


def sse_chunk(content: str) -> bytes:
    document = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + orjson.dumps(document) + b"\n\n"


async def test_every_complete_stream_line_is_held_to_the_line_limit() -> None:
    """A complete oversized line inside one read passed: only the unfinished last line was checked."""
    limit: int = AnswerLimits.model_fields["max_line_bytes"].metadata[0].ge  # the smallest limit allowed
    small = AnswerLimits(max_line_bytes=limit)
    fits = sse_chunk("x" * (limit // 4))
    too_long = sse_chunk("x" * (4 * limit))
    for payload, over in ((fits + b"data: [DONE]\n\n", False), (too_long + b"data: [DONE]\n\n", True)):
        async with (
            one_write_stream(payload) as url,
            LLMClient(config(url, answer_limits=small)) as client,
        ):
            if over:
                with pytest.raises(AnswerTooLarge, match=f"{limit}-byte limit"):
                    await client.chat(MESSAGES, routing_key="s1", max_tokens=20)
            else:
                assert (await client.chat(MESSAGES, routing_key="s1", max_tokens=20)).text


def test_the_usage_tap_holds_at_most_one_line_limit_of_an_unfinished_line() -> None:
    """The gateway's tap re-joined the unfinished line on every read (quadratic in a line with no end:
    1.5 s of a blocked event loop at 2 MiB) and held all of it; now it holds at most the line limit and
    still reads the usage that follows."""
    limits = AnswerLimits()
    tap = UsageTap(streaming=True, max_line_bytes=limits.max_line_bytes)
    piece = b"x" * (limits.max_line_bytes // 16)
    tap.feed(b"data: {")
    for _ in range(8 * 16):  # eight line limits without a newline
        tap.feed(piece)
        assert tap.buffered <= limits.max_line_bytes
    usage = {"prompt_tokens": 7, "completion_tokens": 3}
    tap.feed(b"\n\ndata: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
    tap.finish()
    assert tap.usage == usage and tap.buffered == 0


async def test_a_quarantine_caused_by_one_poison_prompt_lifts_once_the_replica_answers_other_prompts() -> (
    None
):
    """The probe replayed the exact request the replica had failed: a quarantine caused by one prompt no
    replica answers within the caller's schema (a poison prompt) never lifted. The probe is now a request
    some replica answered well."""
    poison = prompt_of("poison").messages
    async with (
        running_simulator(time_scale=0.01) as a,
        running_simulator(time_scale=0.01) as b,
        running_simulator(time_scale=0.01) as c,
        LLMClient(config(a.url, b.url, c.url, policy="session_affinity")) as client,
    ):
        poison_text = (await client.chat(poison, routing_key="poisoner", max_tokens=20)).text

        def schema(text: str) -> str:
            if text == poison_text:
                raise InvalidAnswer("not the caller's schema", kind="schema")
            return text

        first = rendezvous_order("poisoner", client.endpoints)[0]  # where affinity sends the poisoner
        while not first.quarantined:
            with pytest.raises(InvalidAnswer):
                await client.chat(poison, routing_key="poisoner", max_tokens=20, validate=schema)
        for i in range(3):  # other shoppers' prompts: answered well by the replicas still routable
            await client.chat(
                prompt_of(f"s{i}").messages, routing_key=f"s{i}", max_tokens=20, validate=schema
            )
        async with asyncio.timeout(10):  # cool-downs of 0.2 s; before the fix it never came back
            while any(e.quarantined for e in client.endpoints):
                await asyncio.sleep(0.05)
        assert client.answer_health.readmissions >= 1 and first.routable


@contextlib.asynccontextmanager
async def replica_that_hangs_once_quarantined() -> AsyncIterator[tuple[str, dict[str, int], asyncio.Event]]:
    """Answers every request with HTML until ``state["hang"]`` is set, then holds every request until
    the returned event is set (``state["waiting"]`` counts those held)."""
    state = {"hang": 0, "waiting": 0}
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        if not state["hang"]:
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html")
        state["waiting"] += 1
        await release.wait()
        return web.json_response({"choices": [{"message": {"content": "late"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as url:
        try:
            yield url, state, release
        finally:
            release.set()


async def test_a_hanging_answer_probe_does_not_hold_the_health_cycle() -> None:
    """Answer probes ran inside the health cycle's gather: one replica hanging on its probe held every
    other replica's re-admission for up to ``attempt_s``."""
    hold = Timeouts(connect_s=1, attempt_s=60, deadline_s=120)  # a probe held far past the wait below
    async with (
        replica_that_hangs_once_quarantined() as (hanging, state, release),
        running_simulator(time_scale=0.01) as b,
        running_simulator(time_scale=0.01) as c,
        LLMClient(config(hanging, b.url, c.url, policy="round_robin", stream=False, timeouts=hold)) as client,
    ):
        bad, _, ejected = client.endpoints
        i = 0
        while not bad.quarantined:
            await client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=5)
            i += 1
        state["hang"] = 1
        async with asyncio.timeout(10):
            while not state["waiting"]:  # its probe is in flight, and will hang
                await asyncio.sleep(0.05)
        client.eject(ejected, "ejected by the test")
        async with asyncio.timeout(10):
            while not ejected.healthy:
                await asyncio.sleep(0.05)
        assert state["waiting"] == 1 and not release.is_set(), "re-admitted while the probe still hangs"


BURST = 200
"""Prompts of a backlog all in flight at once (``max_in_flight`` is 256 by default)."""
BURST_TIMEOUTS = Timeouts(connect_s=1, attempt_s=30, deadline_s=60)


@pytest.mark.parametrize("kind", ["not_json", "wrong_types", "not_understanding"])
async def test_one_bad_replica_of_two_under_a_burst_turns_at_most_one_percent_into_errors(
    kind: BadAnswer,
) -> None:
    """A backlog's burst puts many calls in flight to the bad replica before its quarantine; their
    failovers to the healthy one drew on the fleet-wide retry budget, and 11-14% of the prompts became
    ``RetryBudgetExhausted`` error records. A failover away from an invalid answer is bounded by
    construction (once per call) and no longer spends the budget."""
    async with (
        running_simulator(time_scale=0.01, bad_answer=kind) as bad,
        running_simulator(time_scale=0.01) as good,
        # the default retry budget; deadlines long enough for a burst on a shared machine
        LLMClient(config(bad.url, good.url, retry=RetrySettings(), timeouts=BURST_TIMEOUTS)) as client,
    ):
        assert client.config.max_in_flight >= BURST
        enricher = Enricher(client)
        results = await asyncio.gather(*(enricher.enrich(prompt_of(f"shopper-{i}")) for i in range(BURST)))
        errors = [r for r in results if isinstance(r, EnrichmentError)]
        assert client.endpoints[0].quarantined
    assert sum(client.endpoints[0].invalid_answers.values()) > 0.01 * BURST, "the burst reached it"
    assert len(errors) <= 0.01 * BURST, Counter(f"{e.error_type}: {e.message[:120]}" for e in errors)
