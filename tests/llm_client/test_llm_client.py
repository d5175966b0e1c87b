"""The LLM client against real simulator replicas over HTTP: streaming with TTFT and cached tokens,
the shopper key as ``x-session-id``, retries on another replica, deadlines, backpressure, health
ejection and re-admission, and answers that fail validation becoming error records."""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

import jsonschema
import orjson
import pytest
from aiohttp import web

from devstack.processes import free_port
from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.errors import BadRequest, DeadlineExceeded, InvalidAnswer, LLMError
from pipeline.enrichment import Enricher, EnrichmentSettings, parse_understanding
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import EnrichmentError, PromptRequest, ShopperInsight
from prompt_assembly.understanding import understanding_json_schema
from serving.simulator.bad_answers import OFF_SCHEMA_ANSWER
from serving.simulator.testing import running_simulator
from tests.helpers import collector_off
from tests.prompt_assembly.test_sessions import event

MESSAGES = [
    {"role": "system", "content": "You describe shoppers. " * 40},
    {"role": "user", "content": "viewed hats"},
]


def config(*urls: str, **overrides: object) -> ClientConfig:
    options: dict[str, object] = {
        "endpoints": list(urls),
        "timeouts": Timeouts(connect_s=1, attempt_s=5, deadline_s=10),
        "health": HealthSettings(interval_s=0.05),
        "retry": RetrySettings(backoff_base_s=0.01),
    }
    options.update(overrides)
    return ClientConfig(**options)  # type: ignore[arg-type]


def a_prompt() -> PromptRequest:
    processor = SessionProcessor()
    session = processor.new_session("s-42")
    processor.apply(session, event("view", 100, shopper="s-42"))
    return processor.apply(session, event("add_to_cart", 101, shopper="s-42")).prompts[0]


async def test_streamed_answer_reports_ttft_and_cached_tokens() -> None:
    async with running_simulator(time_scale=0.05) as sim, LLMClient(config(sim.url)) as client:
        first = await client.chat(MESSAGES, routing_key="s1", max_tokens=40)
        second = await client.chat(MESSAGES, routing_key="s1", max_tokens=40)
    assert first.text and first.completion_tokens > 0 and first.prompt_tokens > 100
    assert 0 < first.ttft_ms < first.latency_ms
    assert first.cached_tokens == 0
    assert second.cached_tokens >= second.prompt_tokens - 32  # all full blocks came from the cache


async def test_non_streamed_answer_and_session_header() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-session-id"))
        return web.json_response(
            {
                "model": "m",
                "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": 7,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 4},
                },
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with LLMClient(config(f"http://127.0.0.1:{port}", stream=False)) as client:
            answer = await client.chat(MESSAGES, routing_key="shopper-9")
    finally:
        await runner.cleanup()
    assert seen == ["shopper-9"]
    assert (answer.text, answer.prompt_tokens, answer.cached_tokens) == ("hi", 7, 4)


async def test_a_failing_replica_is_retried_elsewhere_and_ejected() -> None:
    async with (
        running_simulator(time_scale=0.01, error_rate=1.0) as bad,
        running_simulator(time_scale=0.01) as good,
        LLMClient(config(bad.url, good.url, policy="round_robin")) as client,
    ):
        answers = [await client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=10) for i in range(6)]
        bad_endpoint = client.endpoints[0]
        assert bad_endpoint.ejections >= 1 and bad_endpoint.failed >= 2  # /health answers: re-admitted
    assert all(a.endpoint == client.endpoints[1].name for a in answers)
    assert any(a.attempts == 2 for a in answers)


async def test_refused_connection_ejects_at_once_and_health_readmits() -> None:
    async with running_simulator(time_scale=0.01) as good:
        dead = f"http://127.0.0.1:{free_port()}"
        async with LLMClient(config(dead, good.url, policy="round_robin")) as client:
            answer = await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
            assert answer.endpoint == client.endpoints[1].name
            assert client.endpoints[0].healthy is False and client.endpoints[0].ejections == 1


async def test_health_checker_readmits_a_replica_that_comes_back() -> None:
    async with running_simulator(time_scale=0.01) as sim, LLMClient(config(sim.url)) as client:
        client.eject(client.endpoints[0])
        async with asyncio.timeout(5):
            while not client.endpoints[0].healthy:
                await asyncio.sleep(0.02)
        assert (await client.chat(MESSAGES, routing_key="s", max_tokens=5)).text


async def test_deadline_is_enforced_across_retries() -> None:
    async with running_simulator(time_scale=1.0) as slow, LLMClient(config(slow.url)) as client:
        started = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await client.chat(MESSAGES, routing_key="s1", max_tokens=200, deadline_s=0.3)
        assert time.perf_counter() - started < 1.0


class _CallerState:
    """Something a caller holds in its frame while it waits for the model (a request, its candidates)."""


async def _failed_call_frees_its_caller(client: LLMClient, error: type[LLMError], **call: Any) -> bool:
    """Whether a caller's frame, and what it holds, is freed by reference counting alone once its call
    failed with ``error``: the cyclic collector is off meanwhile."""

    async def ask(state: _CallerState) -> None:
        try:
            await client.chat(MESSAGES, routing_key="s1", **call)
        except error:
            return
        raise AssertionError(f"the call did not fail with {error.__name__}")

    with collector_off():
        state = _CallerState()
        held = weakref.ref(state)
        await ask(state)
        del state
        return held() is None


async def test_a_call_cut_at_its_deadline_leaves_no_reference_cycle() -> None:
    # A DeadlineExceeded reachable from its own traceback (it was once held in a local of the frame
    # that raised it) keeps every caller's frame, and all they hold, until the cyclic collector runs:
    # under a real-time service's load, most requests' objects, and collector pauses of 5-10 ms.
    async with running_simulator(time_scale=1.0) as slow, LLMClient(config(slow.url)) as client:
        assert await _failed_call_frees_its_caller(client, DeadlineExceeded, max_tokens=200, deadline_s=0.2)


async def test_a_call_that_fails_after_a_retry_leaves_no_reference_cycle() -> None:
    retry = RetrySettings(max_attempts=2, backoff_base_s=0.01)
    async with (
        running_simulator(time_scale=0.01, error_rate=1.0) as broken,
        LLMClient(config(broken.url, retry=retry)) as client,
    ):
        assert await _failed_call_frees_its_caller(client, LLMError, max_tokens=5, deadline_s=2)
        assert client.retries >= 1


async def test_bad_request_is_not_retried() -> None:
    async with running_simulator(time_scale=0.01) as sim, LLMClient(config(sim.url)) as client:
        with pytest.raises(BadRequest):
            await client.chat(MESSAGES, routing_key="s1", max_tokens=-5)
        assert client.retries == 0


async def test_concurrency_limit_applies_backpressure() -> None:
    async with (
        running_simulator(time_scale=0.2) as sim,
        LLMClient(config(sim.url, max_in_flight=3)) as client,
    ):
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, client.endpoints[0].outstanding)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client.chat(MESSAGES, routing_key=f"s{i}", max_tokens=20) for i in range(12)))
        watcher.cancel()
    assert peak == 3


async def test_enricher_returns_an_insight_for_a_valid_answer() -> None:
    async with running_simulator(time_scale=0.01) as sim, LLMClient(config(sim.url)) as client:
        result = await Enricher(client).enrich(a_prompt())
    assert isinstance(result, ShopperInsight)
    assert result.request_id == a_prompt().request_id and result.understanding.summary
    assert result.usage.prompt_tokens > 0


async def test_an_invalid_answer_becomes_an_error_record_not_a_crash() -> None:
    # Without guided decoding the stand-in answers free text, which is not a ShopperUnderstanding.
    async with running_simulator(time_scale=0.01) as sim, LLMClient(config(sim.url)) as client:
        result = await Enricher(client, EnrichmentSettings(guided_json=False)).enrich(a_prompt())
    assert isinstance(result, EnrichmentError)
    assert result.error_type == "InvalidAnswer" and result.raw_answer


async def test_an_unreachable_pool_becomes_an_error_record() -> None:
    cfg = config(
        f"http://127.0.0.1:{free_port()}", timeouts=Timeouts(connect_s=0.2, attempt_s=1, deadline_s=0.5)
    )
    async with LLMClient(cfg) as client:
        result = await Enricher(client, EnrichmentSettings(deadline_s=0.5)).enrich(a_prompt())
    assert isinstance(result, EnrichmentError) and result.error_type == "DeadlineExceeded"


def test_parse_understanding_tolerates_fences_and_rejects_garbage() -> None:
    fenced = (
        '```json\n{"interests": ["hats"], "occasion": null, "style": "fun", '
        '"price_sensitivity": "low", "summary": "Likes hats."}\n```'
    )
    assert parse_understanding(fenced).interests == ["hats"]
    # The JSON on the fence's own line: the whole first line was dropped as the language tag.
    assert parse_understanding("```" + fenced.removeprefix("```json\n")).interests == ["hats"]
    for bad in [
        "no json here",
        '{"interests": []}',
        '{"interests": ["a"], "style": "x", "price_sensitivity": "cheap", "summary": "s"}',
    ]:
        with pytest.raises(InvalidAnswer):
            parse_understanding(bad)


GOOD_ANSWER: dict[str, Any] = {
    "interests": ["hats", "capes"],
    "occasion": "school parade",
    "style": "fun",
    "price_sensitivity": "medium",
    "summary": "Parent assembling a witch look.",
}

OFF_SCHEMA_ANSWERS: dict[str, tuple[dict[str, Any], str]] = {
    # what the schema refuses and the model let through before: an extra field, a required one missing
    "extra field": ({**GOOD_ANSWER, "budget": "under $50"}, "does not allow: 'budget'"),
    "occasion missing": (
        {k: v for k, v in GOOD_ANSWER.items() if k != "occasion"},
        "required fields missing: 'occasion'",
    ),
    "both": (
        {**{k: v for k, v in GOOD_ANSWER.items() if k != "summary"}, "text": "a witch look"},
        "does not allow: 'text'; required fields missing: 'summary'",
    ),
    # what both refused already
    "interests not a list": ({**GOOD_ANSWER, "interests": "hats"}, "interests"),
    "six interests": ({**GOOD_ANSWER, "interests": ["a", "b", "c", "d", "e", "f"]}, "interests"),
    "price not in the enum": ({**GOOD_ANSWER, "price_sensitivity": "cheap"}, "price_sensitivity"),
    "empty summary": ({**GOOD_ANSWER, "summary": ""}, "summary"),
    "style too long": ({**GOOD_ANSWER, "style": "s" * 81}, "style"),
    "occasion a number": ({**GOOD_ANSWER, "occasion": 5}, "occasion"),
}


def test_parse_understanding_accepts_an_answer_the_schema_accepts() -> None:
    jsonschema.validate(GOOD_ANSWER, understanding_json_schema())
    assert parse_understanding(orjson.dumps(GOOD_ANSWER).decode()).model_dump() == GOOD_ANSWER


@pytest.mark.parametrize("case", OFF_SCHEMA_ANSWERS)
def test_parse_understanding_refuses_what_the_schema_refuses(case: str) -> None:
    answer, says = OFF_SCHEMA_ANSWERS[case]
    with pytest.raises(jsonschema.ValidationError):  # the schema the server is asked to decode with
        jsonschema.validate(answer, understanding_json_schema())
    text = orjson.dumps(answer).decode()
    with pytest.raises(InvalidAnswer) as refused:
        parse_understanding(text)
    assert refused.value.kind == "schema" and refused.value.raw == text
    assert says in str(refused.value)


async def test_an_answer_with_a_field_the_schema_does_not_allow_becomes_an_error_record() -> None:
    """A replica whose answer holds an extra field and no ``occasion`` (the simulator's ``off_schema``
    fault, over HTTP): the prompt's one result is an ``InvalidAnswer`` error record naming both, with
    the answer kept; before, it was an insight with the field dropped and ``occasion`` made up as null."""
    async with (
        running_simulator(time_scale=0.01, bad_answer="off_schema") as sim,
        LLMClient(config(sim.url)) as client,
    ):
        result = await Enricher(client).enrich(a_prompt())
    assert isinstance(result, EnrichmentError), result
    assert (
        result.error_type == "InvalidAnswer" and result.raw_answer == orjson.dumps(OFF_SCHEMA_ANSWER).decode()
    )
    assert "does not allow: 'budget'" in result.message and "missing: 'occasion'" in result.message


async def test_an_error_record_counts_the_attempts_really_made() -> None:
    # A rejected request is tried once; the error record used to claim retry.max_attempts (3).
    async with running_simulator(time_scale=0.01) as sim, LLMClient(config(sim.url)) as client:
        rejected = EnrichmentSettings.model_construct(max_tokens=-5, deadline_s=10.0, guided_json=True)
        result = await Enricher(client, rejected).enrich(a_prompt())
    assert isinstance(result, EnrichmentError) and result.error_type == "BadRequest"
    assert result.attempts == 1


async def test_a_retried_failure_counts_each_attempt() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = config(*dead, timeouts=Timeouts(connect_s=0.2, attempt_s=1, deadline_s=1.5))
    async with LLMClient(cfg) as client:
        result = await Enricher(client, EnrichmentSettings(deadline_s=1.5)).enrich(a_prompt())
    assert isinstance(result, EnrichmentError)
    assert result.attempts == 2  # one on each replica; then every replica is ejected


async def test_without_a_schema_sent_the_same_answer_is_an_insight() -> None:
    """With ``guided_json`` off no schema goes to the server, and the prompt allows ``occasion`` as
    none: the same answer (an extra field, no ``occasion``) is an insight, not an error that would also
    count against a healthy replica."""
    async with (
        running_simulator(time_scale=0.01, bad_answer="off_schema") as sim,
        LLMClient(config(sim.url)) as client,
    ):
        result = await Enricher(client, EnrichmentSettings(guided_json=False)).enrich(a_prompt())
    assert isinstance(result, ShopperInsight), result
    assert result.understanding is not None and result.understanding.occasion is None
