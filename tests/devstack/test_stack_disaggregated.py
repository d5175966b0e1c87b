"""``StackSettings.context_replicas``: the stack serves disaggregated, as ``serving/trtllm/disagg``.

Its context and generation replicas run their own options files, and the gateway routes a prompt with
``pd_aware``: a prefill on a context server, the decode on a generation server that pulls the prompt's
KV cache. The session's broker, Redis and S3 are given as external services, so only the replicas and
the gateway start here.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from devstack.stack import StackSettings, StackState, stack_down, stack_up
from llm_client import LLMClient
from llm_client.models import Completion


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/admin/stats", timeout=10) as response:
        engine: dict[str, Any] = json.loads(response.read())["engine"]
    return engine


def _chat(url: str, content: str) -> dict[str, Any]:
    body = {"model": "qwen2.5-32b-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": "shopper-pd"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


async def _chat_replicas(state: StackState, content: str) -> Completion:
    """As the benchmarks' jobs call the fleet: their own client of the replicas, no gateway."""
    async with LLMClient(state.replica_client()) as client:
        messages = [{"role": "user", "content": content}]
        return await client.chat(messages, routing_key="shopper-2", max_tokens=16)


def _settings(stack: StackState, state_dir: Path, **overrides: Any) -> StackSettings:
    return StackSettings(
        state_dir=state_dir,
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=stack.redis_url,
        s3_endpoint_url=stack.s3_endpoint_url,
        time_scale=0.01,
        **overrides,
    )


def test_a_disaggregated_stack_prefills_on_a_context_server_and_decodes_on_a_generation_server(
    stack: StackState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.s3_access_key_id or "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.s3_secret_access_key or "")
    state = stack_up(_settings(stack, tmp_path / "pd", replicas=3, context_replicas=1))
    try:
        assert len(state.context_endpoints) == 1 and len(state.llm_endpoints) == 2
        assert state.gateway_url is not None
        # Long enough that the decode server lacks more than max_local_prefill_tokens of it.
        answer = _chat(state.gateway_url, "the shopper browsed " + "running shoes and socks " * 300)
        assert answer["usage"]["completion_tokens"] > 0
        (context,) = state.context_endpoints
        assert _stats(context)["prefill_tokens_computed"] > 1000, "the prompt was prefilled remotely"
        decoded = sum(_stats(url)["decode_tokens"] for url in state.llm_endpoints)
        assert decoded >= answer["usage"]["completion_tokens"] - 1  # the first token came from the prefill
        assert _stats(context)["decode_tokens"] == 0

        before = _stats(context)["prefill_tokens_computed"]
        direct = asyncio.run(_chat_replicas(state, "the shopper browsed " + "hiking boots and gloves " * 300))
        assert direct.text
        prefilled = _stats(context)["prefill_tokens_computed"] - before
        assert prefilled > 1000, "a job's own client prefills on the context server too"
    finally:
        stack_down(tmp_path / "pd")


def test_a_disaggregated_stack_needs_a_generation_replica_and_its_own_simulators(
    stack: StackState, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match="no generation replica"):
        _settings(stack, tmp_path / "a", replicas=2, context_replicas=2)
    with pytest.raises(ValidationError, match="own simulated replicas"):
        _settings(stack, tmp_path / "b", context_replicas=1, llm_endpoints=stack.llm_endpoints)
