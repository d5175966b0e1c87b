"""prefix_aware in front of a replica with chunked prefill (the simulator's ``enable_chunked_prefill``),
over real HTTP: a shopper's next prompt that reaches the replica while its previous prompt is still being
prefilled finds nothing cached (the engine reuses only computed blocks), which is not a lost cache."""

from __future__ import annotations

import asyncio

from llm_client import ClientConfig, LLMClient
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from serving.simulator.testing import running_simulator
from tests.helpers import viewed_prompt


def prompt(shopper: str, events: int) -> list[dict[str, str]]:
    return viewed_prompt(shopper, events, item="kettle", category="Home > Kitchen", hour=11, cents=99)


async def test_a_prompt_sent_during_its_siblings_prefill_is_not_taken_for_a_restart() -> None:
    # 256 tokens per iteration at real speed: the first prompt (~2k tokens) is prefilled over about
    # eight ~100 ms iterations, and the second, sent at once, reaches the replica inside that window.
    async with running_simulator(
        time_scale=1.0, max_num_tokens=256, enable_chunked_prefill=True, stream_coalesce_s=0.0
    ) as sim:
        config = ClientConfig.model_validate(
            {
                "endpoints": [sim.url],
                "policy": "prefix_aware",
                "stream": True,
                "timeouts": {"connect_s": 5, "attempt_s": 60, "deadline_s": 90},
            }
        )
        async with LLMClient(config) as client:
            policy = client.policy
            assert isinstance(policy, PrefixAwarePolicy)
            first = asyncio.create_task(client.chat(prompt("olga", 60), routing_key="olga", max_tokens=2))
            await asyncio.sleep(0)
            second = await client.chat(prompt("olga", 61), routing_key="olga", max_tokens=2)
            await first
            # The replica had not stored the first prompt's blocks when the second arrived ...
            assert second.cached_tokens == 0
            # ... which the policy knows from the first token it was told about: no restart inferred.
            assert policy.stats.restarts_detected == 0 and policy.stats.restart_checks_skipped == 1
            assert client.endpoints[0].restarts_detected == 0
            # Once both are answered, the next prompt is a real hit and a cold answer would count again.
            third = await client.chat(prompt("olga", 62), routing_key="olga", max_tokens=2)
            assert third.cached_tokens > 0.5 * third.prompt_tokens
            sim.replica.reset_cache()
            fourth = await client.chat(prompt("olga", 63), routing_key="olga", max_tokens=2)
            assert fourth.cached_tokens == 0 and policy.stats.restarts_detected == 1
