"""The client's P/D two-step call against simulator context and generation replicas over HTTP: a cold
prompt is prefilled on a context server and decoded on a generation server, a shopper's next prompt
(only its newest events uncached there) is prefilled where it is decoded, and blocks gone by the pull
mean a local prefill, never a failed request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.errors import LLMError
from llm_client.routing.base import RouteRequest
from llm_client.routing.pd_aware import PdAwarePolicy
from prompt_assembly.tokens import count_tokens
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.helpers import until
from tests.llm_client.test_routing_pd_aware import words


def pd_config(generation: str, context: str, **knobs: object) -> ClientConfig:
    return ClientConfig(
        endpoints=[generation],
        context_endpoints=[context],
        policy="pd_aware",
        policy_settings={"policy": "pd_aware", **knobs},
        timeouts=Timeouts(connect_s=1, attempt_s=10, deadline_s=20),
        health=HealthSettings(interval_s=0.05),
    )


@dataclass(frozen=True)
class PdPair:
    """A context and a generation simulator, and a P/D client routing over them."""

    context: RunningSimulator
    generation: RunningSimulator
    client: LLMClient

    @property
    def policy(self) -> PdAwarePolicy:
        policy = self.client.policy
        assert isinstance(policy, PdAwarePolicy)
        return policy


@contextlib.asynccontextmanager
async def pd_pair(
    *,
    context_time_scale: float = 0.0,
    generation_time_scale: float = 0.0,
    context_settings: dict[str, Any] | None = None,
    **knobs: object,
) -> AsyncIterator[PdPair]:
    """``PdPair`` for one test: the simulators' time scales and the context server's settings as it
    needs them, ``knobs`` for the ``pd_aware`` policy (``max_local_prefill_tokens``, ...)."""
    async with (
        running_simulator(role="context", time_scale=context_time_scale, **(context_settings or {})) as ctx,
        running_simulator(role="generation", time_scale=generation_time_scale) as gen,
        LLMClient(pd_config(gen.url, ctx.url, **knobs)) as client,
    ):
        yield PdPair(ctx, gen, client)


async def perf(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/perf_metrics") as response:
        records: list[dict[str, Any]] = await response.json()
    return records


async def sim_metric(url: str, name: str, **labels: str) -> float:
    """One sample of a replica's Prometheus ``/metrics`` (0 when absent)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_a_cold_prompt_is_prefilled_remotely_and_the_next_one_locally() -> None:
    history = words(3000)
    async with pd_pair(max_local_prefill_tokens=512) as pd:
        ctx, gen, client, policy = pd.context, pd.generation, pd.client, pd.policy
        first = await client.chat(messages(history), routing_key="s1", max_tokens=20)
        assert first.text and first.endpoint == client.endpoints[0].name
        assert policy.stats.remote == 1
        ctx_records, gen_records = await perf(ctx.url), await perf(gen.url)
        assert len(ctx_records) == 1 and len(gen_records) == 1
        assert gen_records[0]["simulator"]["transferred_blocks"] > 0

        second = await client.chat(messages(history + words(200, "new")), routing_key="s1", max_tokens=20)
        assert second.text and policy.stats.local_small == 1
        assert await perf(ctx.url) == [], "the newest events were prefilled where they are decoded"
        (local,) = await perf(gen.url)
        assert local["simulator"].get("transferred_blocks") in (None, 0)
        assert second.cached_tokens > 0.8 * second.prompt_tokens


async def test_a_two_step_call_is_timed_from_its_context_step() -> None:
    """The caller waited for the prefill on the context server too: the answer's time to first token
    and latency include it (an admission limit watching the first token must see that queue)."""
    async with pd_pair(context_time_scale=1.0, generation_time_scale=1.0) as pd:
        ctx, client = pd.context, pd.client
        answer = await client.chat(messages(words(3000)), routing_key="s1", max_tokens=8)
        (prefill,) = await perf(ctx.url)
        timing = prefill["perf_metrics"]["timing_metrics"]
        context_ms = (timing["last_token_time"] - timing["arrival_time"]) * 1000
        assert context_ms > 100, "a cold 3,000-token prefill of a 32B model takes a few hundred ms"
        assert answer.ttft_ms >= context_ms
        assert answer.latency_ms >= answer.ttft_ms


async def test_blocks_gone_by_the_pull_mean_a_local_prefill() -> None:
    # the context replica releases a prompt's blocks 1 µs after its first token: gone by the pull
    async with pd_pair(context_settings={"kv_transfer_timeout_s": 1e-6}, max_local_prefill_tokens=0) as pd:
        client, policy = pd.client, pd.policy
        completion = await client.chat(messages(words(3000)), routing_key="s1", max_tokens=20)
        assert completion.text and completion.attempts == 1
        assert policy.stats.remote == 1 and policy.stats.redone_locally == 1
        assert all(e.routable for e in [*client.endpoints, *client.context_endpoints])


async def forwarded(client: LLMClient, text: str) -> tuple[int, dict[str, Any]]:
    """The gateway's path: the caller's body forwarded, the answer read back as the caller gets it."""
    body = {"model": client.config.model, "messages": messages(text), "max_tokens": 20, "stream": False}
    route = RouteRequest("s1", text, count_tokens(text), 20)
    async with client.forward("/v1/chat/completions", orjson.dumps(body), route) as answer:
        status = answer.status
        data = b"".join([chunk async for chunk in answer.chunks()])
    return status, orjson.loads(data)


@pytest.mark.parametrize(
    "context_settings",
    [
        {"kv_transfer_timeout_s": 1e-6},  # released before the pull: the decode server answers 409
        {"advertise_url": "http://127.0.0.1:9"},  # unreachable at the pull: it answers 503
    ],
    ids=["released-409", "unreachable-503"],
)
async def test_forward_prefills_locally_when_the_blocks_are_gone_and_blames_no_one(
    context_settings: dict[str, Any],
) -> None:
    async with pd_pair(context_settings=context_settings, max_local_prefill_tokens=0) as pd:
        gen, client, policy = pd.generation, pd.client, pd.policy
        status, answer = await forwarded(client, words(3000))
        assert status == 200 and answer["choices"][0]["message"]["content"]
        assert policy.stats.remote == 1 and policy.stats.redone_locally == 1
        (decode,) = client.endpoints
        assert decode.routable and decode.consecutive_failures == 0, "the decode server did nothing wrong"
        # The decode server was asked to take the hand-over and answered kv_cache_gone (the simulator
        # keeps no perf record of a request that errored: counting generation_only records proved
        # nothing, it held whether or not the hand-over was tried), then served the caller's own request.
        assert await sim_metric(gen.url, "sim_request_errors_total", reason="kv_cache_gone") == 1
        assert await sim_metric(gen.url, "sim_requests_total", endpoint="chat") == 2
        (served,) = await perf(gen.url)
        assert served["request_type"] != "generation_only", "the caller's request was prefilled there"
        assert served["simulator"].get("transferred_blocks") in (None, 0)


async def test_a_context_server_that_is_down_means_a_local_prefill() -> None:
    async with running_simulator(role="generation", time_scale=0.0) as gen:
        config = pd_config(gen.url, "http://127.0.0.1:9", max_local_prefill_tokens=0)
        async with LLMClient(config) as client:
            completion = await client.chat(messages(words(3000)), routing_key="s1", max_tokens=20)
            policy = client.policy
            assert isinstance(policy, PdAwarePolicy)
            assert completion.text and policy.stats.redone_locally == 1
            assert not client.context_endpoints[0].routable  # ejected: refused connections
            await client.chat(messages(words(3000, "b")), routing_key="s2", max_tokens=20)
            assert policy.stats.local_no_context == 1


async def test_streamed_answers_report_their_largest_inter_token_gap() -> None:
    async with (
        running_simulator(time_scale=0.02, stream_coalesce_s=0.0) as sim,
        LLMClient(ClientConfig(endpoints=[sim.url])) as client,
    ):
        completion = await client.chat(messages(words(500)), routing_key="s1", max_tokens=30)
    assert completion.max_itl_ms is not None and completion.max_itl_ms > 0
    assert completion.max_itl_ms < completion.latency_ms - completion.ttft_ms + 1


@contextlib.asynccontextmanager
async def decode_server_breaking_off_its_refusal() -> AsyncIterator[str]:
    """A generation server that answers ``/health`` and refuses every completion with a 404 whose body
    breaks off (the connection closes before a byte of the declared length came)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(KV_GONE_BODY))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


KV_GONE_BODY = b'{"error": {"type": "kv_cache_gone", "message": "blocks released"}}'
"""What the refusal declares (its length) and never sends."""


async def test_a_refused_handover_whose_body_breaks_off_gives_the_replicas_load_back() -> None:
    """An error while reading a 404/409 hand-over refusal skipped the release: the decode replica's
    outstanding count and token counts leaked for good (and an aiohttp error left the client)."""
    async with (
        running_simulator(role="context", time_scale=0.0) as ctx,
        decode_server_breaking_off_its_refusal() as gen,
        LLMClient(pd_config(gen, ctx.url, max_local_prefill_tokens=0)) as client,
    ):
        with pytest.raises(LLMError):
            await forwarded(client, words(3000))
        (decode,) = client.endpoints
        assert decode.ejections >= 1, "a decode server that breaks off its answers is blamed"
        assert (decode.outstanding, decode.outstanding_prefill_tokens, decode.outstanding_decode_tokens) == (
            0,
            0,
            0,
        )


@pytest.mark.parametrize("path", ["chat", "forward"])
async def test_a_call_cancelled_during_its_context_step_gives_the_decode_booking_back(path: str) -> None:
    """Cancelled while the context server prefills (a newer version of its session, the caller gone,
    its deadline), the call never reaches its decode server: what choosing that server booked for it
    (the shopper counted in flight there, its KV, the prompt in the queued-prefill record) stayed
    booked for good, one prompt more each time."""
    text = words(3000)
    async with pd_pair(context_time_scale=1.0, max_local_prefill_tokens=0) as pd:  # ~5.8k tokens: ~0.8 s
        client, policy = pd.client, pd.policy
        decode = policy.decode
        for n in range(3):
            call: asyncio.Task[Any] = asyncio.create_task(
                client.chat(messages(text), routing_key="s1", max_tokens=20)
                if path == "chat"
                else forwarded(client, text)
            )
            async with asyncio.timeout(10):
                while policy.stats.remote < n + 1:  # planned: the context step begins
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # inside the context step: its prefill takes ~0.8 s of wall time
            assert not call.done()
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            assert decode._key_inflight == {}
            assert decode._booked_kv == {}
            assert len(decode._queued) == 0
            (server,) = client.endpoints
            assert (server.outstanding, server.outstanding_prefill_tokens) == (0, 0)


async def test_a_forwarded_body_that_is_no_json_object_books_no_context_server() -> None:
    """A pass-through body that is not a JSON object cannot be prefilled elsewhere, and goes to the
    decode server unchanged for its own 400. It was read only after the policy had chosen a context
    server, booking it (in flight, a queued prefill, the blocks it would hold) with nothing to give
    that back: a thousand such bodies left a thousand prefills believed queued there."""
    async with pd_pair(max_local_prefill_tokens=512) as pd:
        ctx, client, policy = pd.context, pd.client, pd.policy
        text = " ".join(words(3000))
        route = RouteRequest("s1", text, count_tokens(text), 20)
        for _ in range(3):
            async with client.forward("/v1/chat/completions", b"[1, 2]", route) as forwarded:
                assert forwarded.status == 400
        assert policy.stats.remote == 0
        assert await perf(ctx.url) == []


async def test_a_generation_server_withdrawn_during_the_context_step_is_not_sent_the_call() -> None:
    """The generation server is chosen before the context step; withdrawn while that step runs (a
    capacity hand-off), the call's generation step goes to a server the client kept."""
    async with (
        running_simulator(role="context", time_scale=5.0) as context,
        running_simulator(role="generation", time_scale=1.0) as leaving,
        running_simulator(role="generation", time_scale=1.0) as kept,
    ):
        config = pd_config(leaving.url, context.url, max_local_prefill_tokens=512).model_copy(
            update={"retry": RetrySettings(max_attempts=1, budget_ratio=0, budget_min_tokens=0)}
        )
        async with LLMClient(config) as client:
            calls = [
                asyncio.create_task(
                    client.chat(messages(words(3000, f"w{i}")), routing_key=f"s{i}", max_tokens=50)
                )
                for i in range(2)
            ]
            context_server = client.context_endpoints[0]

            async def in_the_context_step() -> bool:
                return len(context_server.attempts) == 2

            await until(in_the_context_step, 5.0)
            left = client.fleet.endpoints[0]
            client.set_endpoints([kept.url], withdraw_after_s=0.0)
            answers = await asyncio.gather(*calls)
    assert {a.endpoint for a in answers} == {client.fleet.endpoints[0].name} != {left.name}
    assert client.withdrawn == 2
