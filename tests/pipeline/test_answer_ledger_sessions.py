"""The answer ledger supersedes a replayed prompt on its shopper's stored answer only within one session:
another session's answer is no word on this one's prompts (docs/contracts.md, "Versions")."""

from __future__ import annotations

from llm_client import LLMClient
from pipeline.answer_ledger import AnswerLedger
from pipeline.enrichment import Enricher
from prompt_assembly.records import ShopperInsight
from serving.simulator.testing import running_simulator
from sinks.config import SinkSettings
from sinks.redis import RedisSignalSink
from tests.pipeline.test_overload import Shopper, client_config, requests_received, sim_metrics


async def test_a_session_with_a_smaller_epoch_than_the_lost_one_is_still_answered(
    sinks: SinkSettings,
) -> None:
    """After a state loss, a session whose first event is late (a device's offline batch) gets a smaller
    epoch than the lost one, whose answer stays in the signal. Read as "a newer prompt was answered",
    that answer superseded every prompt of the new session unsent, until the signal expired (days): the
    shopper was silenced, where S3 and the insights topic are to get every answer."""
    lost = Shopper("s-smaller-epoch")
    lost.ts = 5000.0  # the lost session began after the offline batch's events
    lost_prompts = [lost.cart() for _ in range(3)]
    after_loss = Shopper("s-smaller-epoch")  # its first event stamped before the lost session began
    new_prompts = [after_loss.cart(), after_loss.cart()]
    assert new_prompts[0].session_epoch < lost_prompts[0].session_epoch
    async with running_simulator(time_scale=0.01) as sim:
        async with LLMClient(client_config(sim.url)) as client:
            ledger = AnswerLedger.from_settings(sinks)
            before = Enricher(client, ledger=ledger)
            answered = [await before.enrich(prompt) for prompt in lost_prompts]
            sink = RedisSignalSink(sinks)
            await sink.write(answered)  # the lost session's answer holds the signal
            paid = requests_received(await sim_metrics(sim))
            enricher = Enricher(client, ledger=ledger)  # the process that lost the sessions
            results = [await enricher.enrich(prompt) for prompt in new_prompts]
            held = sink.redis.hmget(sink.key(lost.shopper_id), ["session_epoch", "seq"])
            signal = await held  # type: ignore[misc]
            await sink.close()
            await ledger.redis.aclose()
        metrics = await sim_metrics(sim)
    assert all(isinstance(r, ShopperInsight) and not r.replayed for r in results), results
    assert [r.request_id for r in results] == [p.request_id for p in new_prompts]
    assert requests_received(metrics) == paid + 2, "each prompt of the new session was asked"
    assert enricher.counts.superseded_answered == 0
    assert [int(v) for v in signal] == [lost_prompts[-1].session_epoch, 3], "the signal's known limit"
