"""At time_scale 1, the simulator's cost model gives the H100 calibration within 10%, and latencies
seen over real HTTP are never earlier than the model says, nor more than twice it.

"Never early" is checked on the raw latency the client sees: a simulator that waits its modelled time
cannot answer before it, so no subtraction is needed there. For "not twice", HTTP and front-end overhead
(JSON, tokenising and hashing the prompt, the event loop) is measured with the same requests against a
replica at time_scale 0, whose GPU time is zero, and subtracted. Subtracting it from the lower bound
too was wrong: the two minima come from different requests, and on fresh-clone CI the instant replica's
best overhead exceeded the timed replica's own by 1-2 ms, so a correct simulator read as "early". Each
figure is the best of three runs (after a warm-up), since a loaded machine only ever adds delay. The
wall clock is held to the model only loosely above: asyncio's sleeps overshoot by up to 10% on some VMs
(measured 6-12 ms on a 100 ms sleep), and a comparison within 10% failed on such a machine with nothing
else running. How close the wall clock comes is a benchmark's figure (``python -m bench.fidelity``); what
this test guards is a simulator that answers early or waits twice.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from prompt_assembly.tokens import token_ids
from serving.simulator.testing import RunningSimulator, running_simulator

pytestmark = pytest.mark.slow

CALIBRATION = {  # qwen2.5-32b rows of h100_prefill_decode.json
    "cold_1024": 123.34384155273438,
    "cold_2048": 246.7969970703125,
    "cold_4096": 495.62603759765625,
    "suffix_4096+256": 61.10492706298828,
    "decode_b1": 54.24476623535156,
}


CLOCK_ROUNDING_MS = 0.1  # the report rounds to 0.1 ms


def _words(n: int, rng: random.Random) -> str:
    """``n`` tokens exactly: every " abcde" is one token of the shared tokenizer."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = "".join(" " + "".join(rng.choices(letters, k=rng.randint(3, 7))) for _ in range(n))
    assert len(token_ids(text)) == n
    return text


async def _chunk_times(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> list[float]:
    """Seconds from sending the request to each content chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    async with http.post(f"{url}/v1/completions", json=body) as response:
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter() - start)
    return times


@pytest.fixture
async def servers() -> AsyncIterator[tuple[RunningSimulator, RunningSimulator]]:
    async with (
        running_simulator(time_scale=1.0, replica_id="timed", cost_model="eager_pytorch") as timed,
        running_simulator(time_scale=0.0, replica_id="instant", cost_model="eager_pytorch") as instant,
    ):
        yield timed, instant


async def test_latencies_match_calibration(servers: tuple[RunningSimulator, RunningSimulator]) -> None:
    timed, instant = servers
    rng = random.Random(7)
    measured: dict[str, float] = {}
    overhead: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for server in (instant, timed):  # connections, first-use imports
            await _chunk_times(http, server.url, _words(512, rng), 2)
        for n in (1024, 2048, 4096):
            ttfts, base = [], []
            for _ in range(3):
                prompt = _words(n, rng)  # fresh words: always a cold prefill
                base.append((await _chunk_times(http, instant.url, prompt, 1))[0])
                ttfts.append((await _chunk_times(http, timed.url, prompt, 1))[0])
            measured[f"cold_{n}"], overhead[f"cold_{n}"] = min(ttfts), min(base)

        prefix = _words(4096, rng)  # 128 full blocks
        await _chunk_times(http, timed.url, prefix, 1)
        await _chunk_times(http, instant.url, prefix, 1)
        ttfts, base = [], []
        for _ in range(3):
            prompt = prefix + _words(256, rng)
            base.append((await _chunk_times(http, instant.url, prompt, 1))[0])
            ttfts.append((await _chunk_times(http, timed.url, prompt, 1))[0])
        measured["suffix_4096+256"], overhead["suffix_4096+256"] = min(ttfts), min(base)
        stats = timed.replica.stats()
        assert stats["engine"]["cached_tokens_served"] >= 3 * 4096

        times = await _chunk_times(http, timed.url, _words(64, rng), 21)
        assert len(times) == 21  # one token per chunk at time_scale 1
        # The mean step, first chunk to last: the replica keeps an absolute schedule, so a step after an
        # overshot sleep is shorter by the overshoot, and any single interval (or their median) can read
        # early while the run as a whole never does.
        measured["decode_b1"] = (times[-1] - times[0]) / (len(times) - 1)
        overhead["decode_b1"] = 0.0  # intervals between chunks of one response carry no request overhead

    cost = timed.replica.cost
    modelled_ms = {
        **{f"cold_{n}": cost.prefill_ms(n) for n in (1024, 2048, 4096)},
        "suffix_4096+256": cost.prefill_ms(256, cached_tokens=4096),
        # 20 steps over the 64-token prompt and the tokens so far
        "decode_b1": statistics.mean(cost.decode_step_ms(1, 64 + k) for k in range(20)),
    }
    report = {
        key: {
            "modelled_ms": round(modelled_ms[key], 1),
            "raw_ms": round(measured[key] * 1000, 1),
            "overhead_ms": round(overhead[key] * 1000, 1),
            "simulated_ms": round((measured[key] - overhead[key]) * 1000, 1),
            "calibration_ms": round(CALIBRATION[key], 1),
        }
        for key in CALIBRATION
    }
    print(json.dumps(report, indent=1))
    for key, row in report.items():
        modelled = modelled_ms[key]
        assert modelled == pytest.approx(row["calibration_ms"], rel=0.10), (key, modelled, row)
        assert row["raw_ms"] >= modelled - CLOCK_ROUNDING_MS, (key, modelled, row)  # never early
        assert row["simulated_ms"] <= 2 * modelled, (key, modelled, row)  # never waits twice
