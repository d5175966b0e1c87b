"""The answer ledger reads in batches (``pipeline.answer_ledger``): prompts handed to the enrichment step
together, as an engine hands over a poll or a replay after a kill, pass latest wins in the order they
were handed over. A shopper's older prompt is then superseded before it is sent, instead of sent and
cancelled in flight a moment later: the replica sees one request per shopper. With a read per prompt
the replies came back in any order, and an older prompt could pass first (on a backlog more than a
third of the calls were such, each one made again by a replay after a kill).

Against the local Redis and a simulated replica over HTTP."""

from __future__ import annotations

import asyncio

from llm_client import LLMClient
from pipeline.answer_ledger import AnswerLedger
from pipeline.enrichment import Enricher
from prompt_assembly.records import ShopperInsight, Superseded
from serving.simulator.testing import running_simulator
from sinks.config import SinkSettings
from tests.pipeline.test_overload import Shopper, client_config, requests_received, sim_metrics

SHOPPERS = 12
VERSIONS = 4


async def test_prompts_handed_over_together_reach_the_replica_once_per_shopper(sinks: SinkSettings) -> None:
    shoppers = [Shopper(f"s-batch-{i}") for i in range(SHOPPERS)]
    versions = [[shopper.cart() for _ in range(VERSIONS)] for shopper in shoppers]
    handed = [versions[s][v] for v in range(VERSIONS) for s in range(SHOPPERS)]  # shoppers interleaved
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        ledger = AnswerLedger.from_settings(sinks)
        enricher = Enricher(client, ledger=ledger)
        results = await asyncio.gather(*(enricher.enrich(prompt) for prompt in handed))
        await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    by_id = {result.request_id: result for result in results}
    for shopper_versions in versions:
        *older, newest = shopper_versions
        assert isinstance(by_id[newest.request_id], ShopperInsight)
        for prompt in older:
            superseded = by_id[prompt.request_id]
            assert isinstance(superseded, Superseded) and not superseded.cancelled_in_flight
            assert superseded.superseded_by is not None
    assert requests_received(metrics) == SHOPPERS, "one call per shopper: none sent and then cancelled"
    assert enricher.counts.cancelled_in_flight == 0
    assert enricher.counts.superseded_queued == SHOPPERS * (VERSIONS - 1)
    assert ledger.counts.read_batches == 1


async def test_a_batch_read_gives_each_prompt_its_own_recorded_answer(sinks: SinkSettings) -> None:
    answered, fresh = Shopper("s-batch-answered").cart(), Shopper("s-batch-fresh").cart()
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            first = await Enricher(client, ledger=ledger).enrich(answered)
            await ledger.redis.aclose()
        async with LLMClient(client_config(sim.url)) as client:  # a restarted process
            ledger = AnswerLedger.from_settings(sinks)
            enricher = Enricher(client, ledger=ledger)
            replayed, new = await asyncio.gather(*(enricher.enrich(p) for p in (answered, fresh)))
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert isinstance(first, ShopperInsight)
    assert isinstance(replayed, ShopperInsight) and replayed.replayed
    assert replayed.model_dump(exclude={"replayed"}) == first.model_dump(exclude={"replayed"})
    assert isinstance(new, ShopperInsight) and not new.replayed and new.request_id == fresh.request_id
    assert requests_received(metrics) == 2
    assert ledger.counts.found == 1 and ledger.counts.read_batches == 1


async def test_a_burst_of_answers_is_recorded_in_one_round_trip(sinks: SinkSettings) -> None:
    prompts = [Shopper(f"s-burst-{i}").cart() for i in range(SHOPPERS)]
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        answers = await asyncio.gather(*(Enricher(client).enrich(p) for p in prompts))  # no ledger yet
    assert all(isinstance(answer, ShopperInsight) for answer in answers)
    ledger = AnswerLedger.from_settings(sinks)
    await asyncio.gather(*(ledger.record(answer) for answer in answers if isinstance(answer, ShopperInsight)))
    found = await asyncio.gather(*(ledger.recorded(p.request_id) for p in prompts))
    ttls = [await ledger.redis.ttl(ledger.keys.answer(p.request_id)) for p in prompts]
    await ledger.redis.aclose()
    assert found == answers
    assert ledger.counts.write_batches == 1 and ledger.counts.recorded == SHOPPERS
    assert ledger.counts.read_batches == 1 and ledger.counts.found == SHOPPERS
    assert all(0 < ttl <= sinks.answer_ttl_s for ttl in ttls)


async def test_a_read_its_redis_client_fails_asks_the_model_not_cancelling(sinks: SinkSettings) -> None:
    """A shared client that decodes replies (``decode_responses=True``) meets a key that holds bytes
    that are not UTF-8 (written by other software): it raises ``UnicodeDecodeError``, not a
    ``RedisError``. Every read of that batch is a read failure and asks the model, as with Redis away;
    the batch's waiters were cancelled instead, so an enrichment step raised ``CancelledError`` with
    nothing stopping it."""
    shoppers = [Shopper("s-ledger-undecodable"), Shopper("s-ledger-neighbour")]
    prompts = [shopper.cart() for shopper in shoppers]
    plain = AnswerLedger.from_settings(sinks)
    await plain.redis.set(plain.keys.answer(prompts[0].request_id), b"\xff\xfe", ex=60)
    await plain.redis.aclose()
    decoding = sinks.redis_client(decode_responses=True)
    ledger = AnswerLedger.from_settings(sinks, redis=decoding)
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enricher = Enricher(client, ledger=ledger)
        results = await asyncio.gather(*(enricher.enrich(p) for p in prompts))
    await decoding.aclose()
    assert all(isinstance(result, ShopperInsight) and not result.replayed for result in results), results
    assert ledger.counts.read_failures == 2
