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
from tests.helpers import until
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


async def test_a_left_callers_keyed_call_is_cancelled_at_the_gateway_by_the_newer_prompt() -> None:
    """A process that died with a prompt in flight leaves its keyed call running at the gateway (so a
    replay could join it). When the shopper's newer prompt arrives from the restarted process, its
    session version supersedes that call: the gateway closes it upstream instead of paying for an
    answer nobody will read."""
    shopper = Shopper("s-left-behind")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=1.0) as sim, running_gateway([sim.url], "round_robin") as gw:
        async with LLMClient(client_config(gw.url)) as dead:
            first = asyncio.create_task(Enricher(dead).enrich(older))
            await until(lambda: sim.replica.engine.stats.decode_tokens > 0)  # prefilled, decoding
            first.cancel()  # the process dies: its connection to the gateway closes
        async with LLMClient(client_config(gw.url)) as restarted:
            result = await Enricher(restarted).enrich(newer)

        async def aborted() -> bool:
            return (await sim_metrics(sim)).get("sim_request_errors_total{reason=aborted}", 0) == 1

        await until(aborted)
        metrics = await sim_metrics(sim)
    assert isinstance(result, ShopperInsight) and result.request_id == newer.request_id
    assert requests_received(metrics) == 2 and metrics["sim_num_requests_running"] == 0
