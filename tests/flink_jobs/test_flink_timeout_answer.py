"""The async stage's timeout meets an answer already back: the prompt's result is that answer, not a
``FlinkAsyncTimeout`` error. The stage runs on PyFlink's own ``AsyncFunctionRunner`` against the stack's
real Redis (the answer ledger) and simulator replicas; the answer's validation is made to outlast the
timeout, so its timer fires with the answer in hand."""

from __future__ import annotations

import time

import orjson
import pytest

from flink_jobs.flink_config import AsyncSettings, NearRealtimeSettings
from flink_jobs.flink_functions import EnrichPrompts
from pipeline import enrichment
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.understanding import ShopperUnderstanding
from tests.conftest import Isolated
from tests.flink_jobs.test_flink_close import CALL_TIMEOUT_S, Outcome, runtime_context, started_async_runner

pytestmark = [pytest.mark.flink]

TIMEOUT_MS = 500
"""The stage's timeout here; the answer's validation takes longer."""


def test_an_answer_back_as_the_timeout_fires_is_the_prompts_result(
    isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse = enrichment.parse_understanding

    def parse_past_the_timeout(text: str, *, schema_sent: bool = True) -> ShopperUnderstanding:
        time.sleep(2 * TIMEOUT_MS / 1000)  # the loop is held: its timer fires once the answer is in
        return parse(text, schema_sent=schema_sent)

    monkeypatch.setattr(enrichment, "parse_understanding", parse_past_the_timeout)
    sinks = isolated.sinks().model_copy(update={"enabled": ("redis",)})
    settings = NearRealtimeSettings(
        llm=isolated.llm(), sinks=sinks, async_io=AsyncSettings(timeout_ms=TIMEOUT_MS)
    )
    processor = SessionProcessor()
    session = processor.new_session("s-timeout-answer")
    event = {"event_id": "t1", "shopper_id": "s-timeout-answer", "type": "add_to_cart", "ts": 1_764_000_000.5}
    event["product"] = {"product_id": "p1", "title": "Trail shoe", "price": 90.0}
    (prompt,) = processor.apply(session, parse_event(orjson.dumps(event))).prompts

    function = EnrichPrompts(settings.to_json())
    function.open(runtime_context())
    runner = started_async_runner()
    try:
        outcome = Outcome()
        runner.run_async(function.async_invoke, prompt.model_dump_json(), outcome)
        assert outcome.done.wait(CALL_TIMEOUT_S) and outcome.error is None, outcome.error
        (value,) = outcome.value
        result = orjson.loads(value)
        counts = function.stats
        tokens = function.enricher.tokens
    finally:
        runner.stop()
        function.close()
    assert result["kind"] == "insight" and result["request_id"] == prompt.request_id, result
    assert tokens.not_landed_prefill == 0 and tokens.landed_prefill > 0
    assert counts.get("llm_timeouts") == 0 and counts.get("llm_insights") == 1
