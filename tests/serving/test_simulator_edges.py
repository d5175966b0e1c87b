"""Requests at the simulator's edges, over real HTTP: what a caller may send must never hold the
replica's event loop, fail with a 500, or leave a served request out of its metrics, and its
simulated times must be the model's at the fast time scales tests and benchmarks run."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from serving.simulator.config import SimulatorConfig
from serving.simulator.replica import REPLICA_KEY
from serving.simulator.testing import running_simulator
from tests.serving.conftest import post_json

PROMPT = "Viewed trail shoes, added a running watch to the basket, searched for rain jackets. " * 4


def _completion(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": "sim", "prompt": prompt, "max_tokens": 20, **extra}


async def test_a_huge_max_tokens_is_refused_without_planning_an_answer_that_long() -> None:
    """trtllm-serve refuses prompt + max_tokens past max_seq_len; the simulator planned the whole
    answer first (a list of 20 million words on the event loop, 14 s here) and refused it after."""
    async with running_simulator(time_scale=0.0) as sim:
        replica = sim.app[REPLICA_KEY]
        job, answer = replica.prepare(
            PROMPT,
            PROMPT,
            max_tokens=20_000_000,
            response_format=None,
            cache_salt=None,
            ignore_eos=True,
            min_tokens=20_000_000,
            streaming=False,
        )
        assert answer.completion_tokens <= replica.config.max_seq_len
        assert job.max_new_tokens == 20_000_000, "the refusal still names what was asked for"
        async with aiohttp.ClientSession() as http:
            status, body = await post_json(
                http, f"{sim.url}/v1/completions", _completion(max_tokens=20_000_000, ignore_eos=True)
            )
    assert status == 400 and "max_seq_len" in body["error"]["message"]


BAD_SCHEMAS = {
    "minItems of the wrong type": {"type": "array", "minItems": "x"},
    "enum that is no list": {"enum": 5},
    "multipleOf past float range": {"type": "number", "minimum": 1e10, "multipleOf": 1e-300},
    "an object that must hold itself": {
        "type": "object",
        "required": ["a"],
        "properties": {"a": {"$ref": "#"}},
    },
    "300,000 items for 5 tokens": {"type": "array", "items": {"type": "string"}, "minItems": 300_000},
    "a string of five million characters": {"type": "string", "minLength": 5_000_000},
}


@pytest.mark.parametrize("schema", BAD_SCHEMAS.values(), ids=BAD_SCHEMAS.keys())
async def test_a_schema_no_answer_can_follow_is_a_400(schema: dict[str, Any]) -> None:
    """A grammar compiler refuses such a schema before the request is queued; the simulator's filler
    raised (a 500) or built the whole instance on the event loop."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    async with running_simulator(time_scale=0.0) as sim, aiohttp.ClientSession() as http:
        status, body = await post_json(
            http, f"{sim.url}/v1/completions", _completion(max_tokens=5, response_format=response_format)
        )
        ok, _ = await post_json(http, f"{sim.url}/v1/completions", _completion())
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert ok == 200, "the replica goes on serving"


async def _best_ttft_ms(time_scale: float) -> float:
    """The least simulated TTFT the replica reports for five cold 256-token prompts, one at a time
    (a loaded machine only ever adds delay, so the best is the model's plus the least overhead)."""
    async with running_simulator(time_scale=time_scale) as sim, aiohttp.ClientSession() as http:
        for i in range(5):
            prompt = f"cold prompt {i} " + "word " * 250
            status, _ = await post_json(http, f"{sim.url}/v1/completions", _completion(prompt, max_tokens=1))
            assert status == 200
        async with http.get(f"{sim.url}/admin/ttft") as response:
            ttfts = (await response.json())["ttft_ms"]
    assert len(ttfts) == 5
    return float(min(ttfts))


async def test_first_tokens_are_stamped_in_model_time_at_a_fast_time_scale() -> None:
    """At time scale 0.01 a sleep's overshoot (about a millisecond of wall time) was stamped as a
    hundred simulated milliseconds: a 256-token prefill reported 121 ms against the model's 34. The
    stamp is now the instant the iteration was due, so the fast scale reports what scale 1 does."""
    real_time = await _best_ttft_ms(1.0)
    fast = await _best_ttft_ms(0.01)
    assert fast <= real_time * 1.5, f"{fast:.1f} ms at time scale 0.01 against {real_time:.1f} at 1"


def _sample(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


async def test_a_request_finished_after_its_client_left_is_counted_as_served() -> None:
    """trtllm-serve notices a gone client once a poll; a request that finishes before that poll was
    served, but no handler was left to count it: /metrics lacked it while /admin/stats had it."""
    async with (
        running_simulator(time_scale=1.0, disconnect_poll_s=2.0) as sim,
        aiohttp.ClientSession() as http,
    ):
        with pytest.raises(TimeoutError):
            async with http.post(
                f"{sim.url}/v1/completions",
                json=_completion(max_tokens=8),
                timeout=aiohttp.ClientTimeout(total=0.05),
            ):
                pass
        await asyncio.sleep(2.5)  # past the poll after the answer was done
        async with http.get(f"{sim.url}/admin/stats") as response:
            stats = await response.json()
        async with http.get(f"{sim.url}/metrics") as response:
            metrics = await response.text()
    assert stats["engine"]["served"] == 1 and stats["engine"]["aborted"] == 0, stats["engine"]
    assert _sample(metrics, "sim_e2e_request_latency_seconds_count") == 1


def test_chunked_prefill_needs_room_for_one_block() -> None:
    """Chunks are whole blocks: with max_num_tokens under block_size no prompt could ever get one and
    the engine spun (632,777 empty iterations in 5 s); such a setting is refused at start."""
    with pytest.raises(ValidationError, match="block_size"):
        SimulatorConfig(enable_chunked_prefill=True, max_num_tokens=16, block_size=32)


async def test_a_prompt_admitted_while_the_loop_lags_gets_no_head_start() -> None:
    """While a batch decodes, the engine's loop catches up after waking late (a sleep's overshoot is not
    the model's), starting the next iteration at the previous deadline. An iteration that admitted a
    prompt then started before the prompt arrived: the handler's own tokenising of a long prompt is
    such a lag, and at time scale 0.01 its milliseconds became a first token hundreds of simulated ms
    early (about 75 ms for a prefill the model prices near 280). No first token comes sooner than the
    model's prefill of the prompt now."""
    async with running_simulator(time_scale=0.01) as sim, aiohttp.ClientSession() as http:
        replica = sim.app[REPLICA_KEY]
        decoding = asyncio.create_task(
            post_json(http, f"{sim.url}/v1/completions", _completion(max_tokens=4000, ignore_eos=True))
        )
        await asyncio.sleep(0.3)  # the long answer decodes: iterations of a few hundred wall µs
        usages = []
        for i in range(5):
            prompt = f"cold prompt {i} " + "word " * 2000
            status, body = await post_json(
                http, f"{sim.url}/v1/completions", _completion(prompt, max_tokens=1)
            )
            assert status == 200
            usages.append(body["usage"])
        async with http.get(f"{sim.url}/admin/ttft") as response:
            ttfts = (await response.json())["ttft_ms"]
        decoding.cancel()
    floor = min(replica.cost.prefill_ms(u["prompt_tokens"] - 1, 0) for u in usages)
    assert len(ttfts) >= 5
    assert min(ttfts[-5:]) >= 0.9 * floor, (ttfts, floor)
