"""A sick P/D context server is judged against its context peers and drained, over HTTP.

Three simulator context servers and two generation servers behind a ``pd_aware`` client that prefills
every prompt remotely. One context server is made sick: slow prefills or 503s through the simulator's
``POST /admin/config``, or blocks it lets go before the pull (``kv_cache_gone`` at the hand-over). The
degradation detector drains it (and only it: the generation servers are not blamed), and from then on
no prompt is sent to it while the healthy context servers prefill every one. Both the parsed call
(``LLMClient.chat``) and the gateway's pass-through (``LLMClient.forward``) are checked.

Before the fix the detector judged the generation servers alone: the context servers' observations were
recorded but never evaluated, and blocks gone at the pull counted against no one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, Timeouts
from llm_client.degradation import DegradationDetector, DegradationSettings
from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteRequest
from llm_client.routing.pd_aware import PdAwarePolicy
from prompt_assembly.tokens import count_tokens
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.llm_client.test_pd_client import messages, sim_metric
from tests.llm_client.test_routing_pd_aware import words

SICKNESSES: dict[str, dict[str, Any]] = {
    # (admin config sent to the sick context server, its launch settings)
    "slow-prefills": {"admin": {"slowdown": 8.0}, "launch": {}},
    "errors-503": {"admin": {"error_rate": 0.5}, "launch": {}},
    # its blocks released 1 µs after the first token: gone by every pull (the decode server answers 409)
    "blocks-gone": {"admin": {}, "launch": {"kv_transfer_timeout_s": 1e-6}},
}

MAX_CALLS = 400
"""Calls allowed before the sick server must be drained (about 15 reach it per judgement)."""


async def admin_config(url: str, update: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/admin/config", json=update) as response:
        assert response.status == 200, await response.text()


async def prompts_received(context: RunningSimulator) -> float:
    return await sim_metric(context.url, "sim_requests_total", endpoint="chat")


@contextlib.asynccontextmanager
async def pd_fleet(sick_launch: dict[str, Any]) -> AsyncIterator[tuple[list[RunningSimulator], LLMClient]]:
    """Three context servers (the first started with ``sick_launch``), two generation servers, and a
    client prefilling every prompt remotely, its detector judging after 8 samples and never re-admitting
    within the test."""
    async with contextlib.AsyncExitStack() as stack:
        contexts = [
            await stack.enter_async_context(
                running_simulator(role="context", time_scale=0.05, **(sick_launch if i == 0 else {}))
            )
            for i in range(3)
        ]
        generations = [
            await stack.enter_async_context(running_simulator(role="generation", time_scale=0.0))
            for _ in range(2)
        ]
        config = ClientConfig(
            endpoints=[g.url for g in generations],
            context_endpoints=[c.url for c in contexts],
            policy="pd_aware",
            policy_settings={"policy": "pd_aware", "max_local_prefill_tokens": 0},
            timeouts=Timeouts(connect_s=1, attempt_s=10, deadline_s=20),
            health=HealthSettings(interval_s=0.05),
        )
        judging = DegradationSettings(min_samples=8, cooldown_s=3600, max_cooldown_s=3600)
        detector = DegradationDetector(judging)
        client = await stack.enter_async_context(LLMClient(config, degradation=detector))
        yield contexts, client


async def chat_call(client: LLMClient, key: str) -> None:
    answer = await client.chat(messages(words(2000, key)), routing_key=key, max_tokens=8)
    assert answer.text


async def forward_call(client: LLMClient, key: str) -> None:
    text = words(2000, key)
    body = {"model": client.config.model, "messages": messages(text), "max_tokens": 8, "stream": False}
    route = RouteRequest(key, text, count_tokens(text), 8)
    async with client.forward("/v1/chat/completions", orjson.dumps(body), route) as answer:
        assert answer.status == 200
        data = orjson.loads(b"".join([chunk async for chunk in answer.chunks()]))
    assert data["choices"][0]["message"]["content"]


CALLS: dict[str, Callable[[LLMClient, str], Awaitable[None]]] = {"chat": chat_call, "forward": forward_call}


@pytest.mark.parametrize("path", list(CALLS))
@pytest.mark.parametrize("sickness", list(SICKNESSES))
async def test_a_sick_context_server_is_drained_and_gets_no_more_prompts(sickness: str, path: str) -> None:
    call = CALLS[path]
    async with pd_fleet(SICKNESSES[sickness]["launch"]) as (contexts, client):
        policy = client.policy
        assert isinstance(policy, PdAwarePolicy)
        sick_sim, healthy_sims = contexts[0], contexts[1:]
        if SICKNESSES[sickness]["admin"]:
            await admin_config(sick_sim.url, SICKNESSES[sickness]["admin"])
        sick = next(e for e in client.context_endpoints if e.url == sick_sim.url)

        calls = 0
        while not sick.drained:
            assert calls < MAX_CALLS, (
                f"the sick context server was not drained after {calls} calls: "
                f"{client.degradation.signals(sick)}, peers "
                f"{[client.degradation.signals(e) for e in client.context_endpoints if e is not sick]}"
            )
            await call(client, f"k{calls}")
            calls += 1

        changes = [(c.endpoint, c.action) for c in client.degradation.changes]
        assert changes == [(sick.name, "drained")], "the sick context server, and no one else"
        generation: list[Endpoint] = client.endpoints
        for decode in generation:
            assert decode.routable and decode.failed == 0, f"{decode.name} was blamed"
            assert client.degradation.signals(decode).errors == 0.0

        # Drained: the prompts go to the healthy context servers, none to the sick one.
        sick_before = await prompts_received(sick_sim)
        healthy_before = [await prompts_received(s) for s in healthy_sims]
        remote_before = policy.stats.remote
        for i in range(30):
            await call(client, f"after{i}")
        assert await prompts_received(sick_sim) == sick_before, "a drained context server got a prompt"
        healthy_after = [await prompts_received(s) for s in healthy_sims]
        assert sum(healthy_after) - sum(healthy_before) == 30, "every prompt prefilled on a healthy one"
        assert policy.stats.remote - remote_before == 30
        assert sick.drained and all(e.routable for e in client.context_endpoints if e is not sick)
