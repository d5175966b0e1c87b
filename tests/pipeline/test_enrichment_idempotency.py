"""The enrichment step sends a prompt's ``request_id`` as its idempotency key, so behind the gateway
(``shopper router serve``) a prompt sent again by another process (an engine restarted after a crash,
before the answer ledger held the answer) joins the call already in flight or reuses its answer: the
replica is paid once. Real parts: a simulated replica and the gateway over HTTP."""

from __future__ import annotations

import asyncio

from llm_client import LLMClient
from pipeline.enrichment import Enricher
from prompt_assembly.records import ShopperInsight
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import running_gateway
from tests.pipeline.test_overload import Shopper, client_config, requests_received, sim_metrics


async def test_the_same_prompt_from_two_processes_is_paid_once_behind_the_gateway() -> None:
    prompt = Shopper("s-idempotent").cart()
    async with running_simulator(time_scale=0.05) as sim, running_gateway([sim.url], "round_robin") as gw:
        # Two enrichers with clients of their own: two processes, neither with an answer ledger,
        # whose claims cannot see each other's prompts.
        async with LLMClient(client_config(gw.url)) as first, LLMClient(client_config(gw.url)) as second:
            results = await asyncio.gather(Enricher(first).enrich(prompt), Enricher(second).enrich(prompt))
        metrics = await sim_metrics(sim)
    assert all(isinstance(r, ShopperInsight) and r.request_id == prompt.request_id for r in results)
    a, b = results
    assert isinstance(a, ShopperInsight) and isinstance(b, ShopperInsight)
    assert a.understanding == b.understanding
    assert requests_received(metrics) == 1, "the second call joined or reused the first"
