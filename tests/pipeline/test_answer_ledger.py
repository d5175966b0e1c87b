"""Never pay twice: a prompt replayed after its answer was recorded (a restarted process, a new
``Enricher``) is answered from the ledger in the real Redis, and the replica over HTTP sees no second
request. Also: superseded results never touch a shopper's signal, and accounting balances with them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from llm_client import LLMClient
from llm_client.hooks import Attempt
from llm_client.models import Completion
from pipeline import enrichment
from pipeline.accounting import Accounting
from pipeline.answer_ledger import AnswerLedger
from pipeline.enrichment import Enricher, EnrichmentSettings, parse_understanding
from pipeline.overload import OverloadSettings
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import PromptRequest, ShopperInsight, Superseded, parse_result
from prompt_assembly.understanding import ShopperUnderstanding
from serving.simulator.testing import running_simulator
from sinks.config import SinkSettings
from sinks.redis import RedisSignalSink
from tests.fault_kit import TcpProxy
from tests.pipeline.test_overload import Shopper, client_config, requests_received, sim_metrics
from tests.prompt_assembly.test_sessions import event


async def test_a_replayed_prompt_is_answered_from_the_ledger_without_a_call(sinks: SinkSettings) -> None:
    prompt = Shopper("s-replayed").cart()
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            first = await Enricher(client, ledger=ledger).enrich(prompt)
            await ledger.redis.aclose()
        paid = requests_received(await sim_metrics(sim))
        # a restarted process: a new client, a new enricher, a new connection to the same ledger
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            enricher = Enricher(client, ledger=ledger)
            replayed = await enricher.enrich(prompt)
            ttl = await ledger.redis.ttl(ledger.keys.answer(prompt.request_id))
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(first, ShopperInsight) and not first.replayed
    assert isinstance(replayed, ShopperInsight) and replayed.replayed
    assert replayed.model_dump(exclude={"replayed"}) == first.model_dump(exclude={"replayed"})
    assert paid == 1 and requests_received(metrics) == paid  # no second call at the replica
    assert enricher.counts.skipped_answered == 1
    assert 0 < ttl <= sinks.answer_ttl_s


async def test_superseded_results_leave_the_signal_alone_and_are_accounted(sinks: SinkSettings) -> None:
    prompt = Shopper("s-superseded").cart()
    superseded = Superseded(
        request_id=prompt.request_id,
        shopper_id=prompt.shopper_id,
        seq=prompt.seq,
        reason=prompt.reason,
        cause="newer_prompt",
        superseded_by="s-superseded:0:99",
        last_event_ts=prompt.last_event_ts,
        produced_at=time.time(),
    )
    sink = RedisSignalSink(sinks)
    await sink.write([superseded])
    stored = await sink.redis.exists(sink.key(prompt.shopper_id), sink.keys.signal_errors(prompt.shopper_id))
    await sink.close()
    assert stored == 0 and sink.superseded_skipped == 1 and sink.errors_counted == 0
    assert parse_result(superseded.model_dump_json()) == superseded
    accounting = Accounting(prompts=3, insights=1, errors=1, superseded=1)
    assert accounting.prompts_unaccounted == 0


async def test_with_the_ledger_off_a_replayed_prompt_is_paid_again(sinks: SinkSettings) -> None:
    """What happened before the ledger, still available as a setting: every replay is a new call."""
    prompt = Shopper("s-paid-twice").cart()
    off = EnrichmentSettings(answer_ledger=False)
    async with running_simulator(time_scale=0.01) as sim:
        for _ in range(2):  # the first process, then the restarted one
            async with LLMClient(client_config(sim.url)) as client:
                ledger = AnswerLedger.from_settings(sinks)
                result = await Enricher(client, off, ledger=ledger).enrich(prompt)
                await ledger.redis.aclose()
            assert isinstance(result, ShopperInsight) and not result.replayed
        metrics = await sim_metrics(sim)
    assert requests_received(metrics) == 2


async def test_a_replayed_prompt_older_than_the_stored_answer_is_superseded_without_a_call(
    sinks: SinkSettings,
) -> None:
    """A shopper's older prompt, superseded before a crash by the newer one whose answer is stored,
    comes back in the replay with nothing newer waiting: the signal's version supersedes it unsent."""
    shopper = Shopper("s-outrun")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            answered = await Enricher(client, ledger=ledger).enrich(newer)
            sink = RedisSignalSink(sinks)
            await sink.write([answered])  # what the engine's sink does with it
            await sink.close()
            paid = requests_received(await sim_metrics(sim))
            enricher = Enricher(client, ledger=ledger)  # the restarted process
            replayed_older = await enricher.enrich(older)
            replayed_newer = await enricher.enrich(newer)
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(answered, ShopperInsight) and paid == 1
    assert isinstance(replayed_older, Superseded), replayed_older
    assert replayed_older.cause == "newer_prompt" and replayed_older.superseded_by == newer.request_id
    assert isinstance(replayed_newer, ShopperInsight) and replayed_newer.replayed
    assert requests_received(metrics) == paid  # neither replay reached the replica
    assert enricher.counts.superseded_answered == 1 and enricher.counts.skipped_answered == 1


async def test_under_fifo_a_replayed_prompt_older_than_the_stored_answer_is_answered(
    sinks: SinkSettings,
) -> None:
    """``fifo`` answers every prompt: a consumer that needs an answer to each (docs/overload.md). The
    signal's version superseded a replayed older prompt under every policy, so after a restart such a
    consumer lost the answers of prompts the crash had caught unanswered."""
    shopper = Shopper("s-fifo-outrun")
    older, newer = shopper.cart(), shopper.cart()
    fifo = EnrichmentSettings(overload=OverloadSettings(policy="fifo"))
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            answered = await Enricher(client, fifo, ledger=ledger).enrich(newer)
            sink = RedisSignalSink(sinks)
            await sink.write([answered])
            await sink.close()
            replayed_older = await Enricher(client, fifo, ledger=ledger).enrich(older)  # restarted
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(answered, ShopperInsight)
    assert isinstance(replayed_older, ShopperInsight) and not replayed_older.replayed, replayed_older
    assert requests_received(metrics) == 2


def _pause(shopper_id: str, *, view_again_after_s: float | None) -> PromptRequest:
    """The browse pause of a shopper's first view, as a timer fires it; with ``view_again_after_s``, a
    second view read first (within the quiet period, so it joins the same pause)."""
    processor = SessionProcessor()
    session = processor.new_session(shopper_id)
    processor.apply(session, event("view", 1000.0, shopper=shopper_id))
    if view_again_after_s is not None:
        processor.apply(session, event("view", 1000.0 + view_again_after_s, shopper=shopper_id))
    assert session.pending is not None
    (prompt,) = processor.fire_pending(session, session.pending.due_ts)
    return prompt


async def test_the_same_version_of_other_events_is_answered_on_its_own(sinks: SinkSettings) -> None:
    """A restored Flink job can make a session version of other events than the run before the failure:
    its restored timer waits for the replay (``flink_jobs.pause_timers``), which may add a view the run
    before had read only after that timer fired. Answered from the record, that view would be named by
    no result; so the prompt is a call of its own, and its answer replaces the record."""
    before_failure = _pause("s-other-events", view_again_after_s=None)
    replayed = _pause("s-other-events", view_again_after_s=19.0)
    assert replayed.request_id == before_failure.request_id
    assert replayed.new_event_ids != before_failure.new_event_ids
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            await Enricher(client, ledger=ledger).enrich(before_failure)
            enricher = Enricher(client, ledger=ledger)  # the restored job's runner
            answer = await enricher.enrich(replayed)
            recorded = await ledger.recorded(replayed.request_id)
            again = await Enricher(client, ledger=ledger).enrich(replayed)  # and its own replay
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(answer, ShopperInsight) and not answer.replayed
    assert answer.new_event_ids == replayed.new_event_ids
    assert recorded is not None and recorded.new_event_ids == replayed.new_event_ids
    assert isinstance(again, ShopperInsight) and again.replayed
    assert requests_received(metrics) == 2
    assert ledger.counts.other_events == 1 and enricher.counts.skipped_answered == 0
    assert ledger.counts.found == 2, "found counts the answers returned: the record read back, its replay"


async def test_the_same_version_that_trimmed_other_events_is_answered_on_its_own(sinks: SinkSettings) -> None:
    """The same version and the same new events, but a session trimmed at another point: the answer's
    ``trimmed_event_ids`` would name other events than the prompt's, so the record is not reused."""
    before_failure = _pause("s-other-trim", view_again_after_s=None)
    replayed = before_failure.model_copy(
        update={"trimmed_event_ids": [*before_failure.trimmed_event_ids, "e-trimmed-by-the-replay"]}
    )
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            await Enricher(client, ledger=ledger).enrich(before_failure)
            enricher = Enricher(client, ledger=ledger)
            answer = await enricher.enrich(replayed)
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(answer, ShopperInsight) and not answer.replayed
    assert answer.trimmed_event_ids == replayed.trimmed_event_ids
    assert requests_received(metrics) == 2
    assert ledger.counts.other_events == 1 and enricher.counts.skipped_answered == 0


async def test_a_ledger_whose_redis_stops_answering_costs_a_timeout_not_the_stream(
    sinks: SinkSettings, tmp_path: Path
) -> None:
    """Redis accepts the connection and stops answering (a stalled server, a failover, a dropped route:
    here a proxy held with SIGSTOP). The client had no socket timeout, so the ledger's read waited for
    good, and so did every prompt behind it; its write held the prompt's admission slot. Now a read or
    write gets ``SinkSettings.redis_timeout_s``, then counts as failed: the prompt asks the model and
    its answer is only not saved, as docs/overload.md promises for Redis away."""
    proxy = TcpProxy(tmp_path, urlsplit(sinks.redis_url).port or 6379, name="redis-proxy")
    proxy.start()
    try:
        held = sinks.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{proxy.port}/0", "redis_timeout_s": 0.5}
        )
        async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(held)
            await ledger.redis.ping()  # the pool's connection, made before the stall
            proxy.hold()
            enricher = Enricher(client, ledger=ledger)
            async with asyncio.timeout(20):  # a bound on a hang, not a timing assertion
                result = await enricher.enrich(Shopper("s-stalled").cart())
            paid = requests_received(await sim_metrics(sim))
            proxy.release()
            await ledger.redis.aclose()
    finally:
        proxy.stop()
    assert isinstance(result, ShopperInsight) and not result.replayed
    assert paid == 1, "the model was asked"
    assert ledger.counts.read_failures >= 1 and ledger.counts.write_failures == 1


async def test_an_answer_back_as_its_caller_is_cancelled_is_recorded_and_not_paid_again(
    sinks: SinkSettings,
) -> None:
    """The caller's own timeout (the Flink job's async timeout) can fire in the loop pass the answer
    came back in, before the prompt's work resumes with it. That answer is paid for: it is recorded,
    its tokens count as landed, and the replay is answered from the ledger. It was dropped with the
    cancellation, and paid again."""
    prompt = Shopper("s-cut-as-answered").cart()
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            enricher = Enricher(client, ledger=ledger)
            caller = asyncio.create_task(enricher.enrich(prompt))

            def cancel_the_caller(_attempt: Attempt, _completion: Completion) -> None:
                # Queued ahead of the step that hands the answer back: the cancellation meets it in.
                asyncio.get_running_loop().call_soon(caller.cancel)

            client.hooks.attempt_finished.append(cancel_the_caller)
            done, _ = await asyncio.wait([caller], timeout=30)
            client.hooks.attempt_finished.clear()
            paid = requests_received(await sim_metrics(sim))
            restarted = Enricher(client, ledger=ledger)
            replayed = await restarted.enrich(prompt)
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert done == {caller} and caller.cancelled()
    assert paid == 1
    assert isinstance(replayed, ShopperInsight) and replayed.replayed, replayed
    assert requests_received(metrics) == paid  # the replay asked the replica nothing
    assert restarted.counts.skipped_answered == 1
    assert enricher.tokens.landed_prefill > 0 and enricher.tokens.not_landed_prefill == 0


async def test_an_answer_read_as_its_caller_is_cancelled_is_recorded_and_not_paid_again(
    sinks: SinkSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation comes while the call is still on its last step, the answer's bytes read and
    being parsed (so its last bytes and the caller's timer came in the same pass). Passed on to the
    call at once, it ended the call cancelled with its answer in hand; now the call is cut a pass
    later, as a displaced one is, and by then it is done."""
    prompt = Shopper("s-cut-while-read").cart()
    caller: asyncio.Task[object] | None = None

    def parse_then_cancel_the_caller(text: str, *, schema_sent: bool = True) -> ShopperUnderstanding:
        assert caller is not None
        caller.cancel()
        return parse_understanding(text, schema_sent=schema_sent)

    monkeypatch.setattr(enrichment, "parse_understanding", parse_then_cancel_the_caller)
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            enricher = Enricher(client, ledger=ledger)
            caller = asyncio.create_task(enricher.enrich(prompt))
            done, _ = await asyncio.wait([caller], timeout=30)
            paid = requests_received(await sim_metrics(sim))
            monkeypatch.undo()
            replayed = await Enricher(client, ledger=ledger).enrich(prompt)
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert done == {caller} and caller.cancelled()
    assert paid == 1
    assert isinstance(replayed, ShopperInsight) and replayed.replayed, replayed
    assert requests_received(metrics) == paid
    assert enricher.tokens.not_landed_prefill == 0


async def test_a_copy_whose_read_missed_a_write_of_this_process_is_answered_without_a_call(
    sinks: SinkSettings,
) -> None:
    """A replayed copy in the process that answered it, whose ledger read Redis answered before the
    answer's write but that came back after the first copy's call had ended (its claim gone): here the
    write is undone instead, which Redis then answers the same way. The process's own record answers."""
    prompt = Shopper("s-raced").cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        ledger = AnswerLedger.from_settings(sinks)
        enricher = Enricher(client, ledger=ledger)
        first = await enricher.enrich(prompt)
        await ledger.redis.delete(ledger.keys.answer(prompt.request_id))  # as Redis read it
        copy = await enricher.enrich(prompt)
        await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(first, ShopperInsight) and isinstance(copy, ShopperInsight) and copy.replayed
    assert requests_received(metrics) == 1
    assert enricher.counts.skipped_answered == 1
