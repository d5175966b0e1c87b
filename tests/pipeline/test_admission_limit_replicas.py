"""The adaptive admission limit is per replica (docs/overload.md): when the replicas it is read for
change (a gateway names its fleet in its first answer, capacity shifting moves replicas) the limit is
scaled with them, cuts and growth otherwise as before."""

from __future__ import annotations

from llm_client import LLMClient
from pipeline.admission_limit import AdaptiveAdmissionLimit, AdaptiveLimitSettings
from pipeline.enrichment import Enricher
from prompt_assembly.records import ShopperInsight
from serving.simulator.testing import running_simulator
from tests.gateway.test_gateway import running_gateway
from tests.pipeline.test_overload import Shopper, client_config

FAST, QUEUED = 600.0, 5000.0  # ms to first token: a prefill, and a prompt that waited at the replica


def test_the_limit_is_scaled_with_the_replicas_it_is_read_for() -> None:
    """Held as a total, the limit read 16 for one address, then 17 once that address said 17 replicas
    stood behind it (the floor), where 16 a replica is 272; replicas moved in by capacity shifting found
    it where it was, a fleet's limit spread over more replicas."""
    replicas = [1]
    limit = AdaptiveAdmissionLimit(AdaptiveLimitSettings(), lambda: replicas[0], 64, clock=lambda: 0.0)
    assert limit() == 16
    replicas[0] = 17  # the gateway's first answer names the replicas behind it
    assert limit() == 16 * 17
    replicas[0] = 2  # capacity shifting took fifteen away
    assert limit() == 32
    for _ in range(8):
        limit.observe(FAST, demand=True)  # one more per answer, as before
    assert limit() == 40
    replicas[0] = 4  # and moved two in: 20 a replica still
    assert limit() == 80
    limit.observe(QUEUED, demand=True)  # a cut is x0.75 of the fleet's limit, as before
    assert limit() == 60


async def test_behind_a_gateway_the_limit_starts_at_16_per_replica_behind_it() -> None:
    """A stream job calls the gateway, one address: its limit is 16 until the first answer says how many
    replicas stand behind it (``x-gateway-routable-replicas``), then 16 for each of them."""
    async with (
        running_simulator(time_scale=0.01) as one,
        running_simulator(time_scale=0.01) as two,
        running_simulator(time_scale=0.01) as three,
        running_gateway([one.url, two.url, three.url], "prefix_aware") as gateway,
        LLMClient(client_config(gateway.url)) as client,
    ):
        enricher = Enricher(client)
        before = enricher.fleet_limit()
        result = await enricher.enrich(Shopper("s-behind-a-gateway").cart())
        after = (enricher.fleet_limit.floor, enricher.fleet_limit(), enricher.gate.limit)
    assert isinstance(result, ShopperInsight), result
    assert before == 16
    assert after == (3, 48, 48), "16 for each replica the gateway named"
