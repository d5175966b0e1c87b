"""A replica found restarted only on evidence: blocks it is known to have computed came back cold.

The client infers a restart when a prompt expected to hit comes back with nothing cached, and clears
what it believes that replica holds. In a burst that inference fired on replicas that had not
restarted (``make demo`` printed it 12 times on a fresh clone): the expected hit was the head every
prompt shares (system prompt and header), recorded on the replica by routing *other* shoppers' prompts
that were still waiting there, and every prompt admitted in the replica's first iterations found it
not yet computed. Pure logic first, then the burst against simulator replicas over HTTP.
"""

from __future__ import annotations

import asyncio

from llm_client import ClientConfig, LLMClient
from llm_client.routing.base import RouteOutcome
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from prompt_assembly.prompt import head_tokens
from prompt_assembly.tokens import count_tokens, messages_text
from serving.simulator.testing import running_simulator
from tests.helpers import until, viewed_prompt
from tests.llm_client.test_routing_prefix_aware import endpoints, shopper_prompt

SHORT = 5
"""Events in a short prompt: the shared head is over ``min_hit_fraction`` of it, so it counts as a hit."""


def test_a_head_believed_only_because_other_prompts_were_routed_there_is_no_evidence_of_a_restart() -> None:
    policy, (replica,) = PrefixAwarePolicy(), endpoints(1)
    first = shopper_prompt("ann", SHORT)
    assert policy.choose(first, [replica]) is replica  # routed, still queued there: nothing computed
    second = shopper_prompt("bob", SHORT)
    assert policy.choose(second, [replica]) is replica
    assert policy.estimate_uncached_tokens(second, replica) < second.prompt_tokens, "the head is believed"
    cold = RouteOutcome(True, second.prompt_tokens, cached_tokens=0)  # admitted with the first: cold
    assert not policy.observe(second, replica, cold).restart_detected
    # Once a prompt there has computed the head, a cold answer where it was expected is evidence again.
    policy.prefill_done(first, replica)
    third = shopper_prompt("cat", SHORT)
    assert policy.choose(third, [replica]) is replica
    assert policy.observe(third, replica, RouteOutcome(True, third.prompt_tokens, 0)).restart_detected
    assert policy.stats.restarts_detected == 1


BLOCKER_SCALE = 1.0
"""Simulated H100 time: the blocker's prefill of a few thousand tokens holds the engine for most of a
second, while the shoppers' prompts arrive and queue."""
BURST = 20
"""Shoppers' first prompts waiting together in one replica's queue: more than one iteration's
``max_num_tokens`` (8192) of them, so the first iteration admits many at once."""


async def test_a_burst_of_new_shoppers_finds_no_replica_restarted() -> None:
    """One replica busy with an unrelated long prefill while twenty new shoppers' short prompts queue
    behind it: the next iteration admits many of them at once, and all of those find nothing cached,
    the head they share included."""
    prompts = [
        viewed_prompt(f"shopper-{i}", SHORT, item="lantern", category="Home > Decor") for i in range(BURST)
    ]
    blocker = [{"role": "user", "content": " ".join(f"w{i}" for i in range(1800))}]  # ~7.9k tokens
    async with (
        # an engine that admits prompts sharing an uncomputed head together (trtllm without its
        # beneficialToSkip deferral, which holds them back an iteration to reuse the head)
        running_simulator(time_scale=BLOCKER_SCALE, defer_shared_prefixes=False) as replica,
        LLMClient(ClientConfig(endpoints=[replica.url], policy="prefix_aware")) as client,
    ):
        policy = client.policy
        assert isinstance(policy, PrefixAwarePolicy)
        assert head_tokens("shopper-0") >= policy.restart_min_expected_tokens, (
            "the head could look like a hit"
        )
        busy = asyncio.create_task(client.chat(blocker, routing_key="blocker", max_tokens=2))
        # sent and admitted: its prefill holds the engine
        await until(lambda: replica.replica.engine.stats.iterations > 0)
        completions = await asyncio.gather(
            *(
                client.chat(
                    p, routing_key=f"shopper-{i}", max_tokens=2, prompt_tokens=count_tokens(messages_text(p))
                )
                for i, p in enumerate(prompts)
            )
        )
        await busy
        assert sum(c.cached_tokens == 0 for c in completions) > 1, "admitted together, cold"
        assert policy.stats.restarts_detected == 0
        assert client.endpoints[0].restarts_detected == 0
