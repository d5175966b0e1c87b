"""``python -m serving.simulator`` prints its config, binds port 0, and says READY with the real port."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest

from serving.simulator.__main__ import parse_args
from serving.simulator.launch import simulator_argv

REPO = Path(__file__).resolve().parents[2]


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIM_REPLICA_ID", "from-env")
    monkeypatch.setenv("SIM_TIME_SCALE", "0.5")
    config = parse_args(["--replica-id", "from-flag", "--max-batch", "8"])
    assert (config.replica_id, config.time_scale, config.max_batch) == ("from-flag", 0.5, 8)


async def test_subprocess_on_port_zero() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SIM_ERROR_RATE": "0"}
    proc = await asyncio.create_subprocess_exec(
        *simulator_argv(replica_id="cli-r1", time_scale=0),
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        config = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert config["replica_id"] == "cli-r1" and config["time_scale"] == 0.0
        ready = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        assert ready.startswith("READY http://127.0.0.1:")
        url = ready.split(" ", 1)[1]
        assert not url.endswith(":0")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as r:
            assert r.status == 200 and r.headers["x-replica-id"] == "cli-r1"
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_chunked_prefill_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).enable_chunked_prefill is False
    monkeypatch.setenv("SIM_ENABLE_CHUNKED_PREFILL", "true")
    monkeypatch.setenv("SIM_MAX_NUM_TOKENS", "2048")
    config = parse_args(["--context-chunking-policy", "equal_progress"])
    assert config.enable_chunked_prefill and config.max_num_tokens == 2048
    assert config.context_chunking_policy == "equal_progress"
    assert parse_args(["--enable-chunked-prefill", "false"]).enable_chunked_prefill is False
