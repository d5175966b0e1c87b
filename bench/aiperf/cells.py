"""One measured cell: a fresh fleet of simulator replicas, ``shopper router serve`` in front of them with
one policy, and one ``aiperf profile`` run at one rate through it, read back from aiperf's own export.

Every cell starts from cold replicas and a new gateway, so no policy inherits the caches (or the learned
state) another one left behind; each cell's conversations are the same (same seed), so the policies see
the same prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.aiperf.install import TOKENIZER_NAME, AiperfInstall
from bench.common import REPO
from devstack.served_process import start_served
from serving.simulator.launch import SimulatorFleet

MODEL = "qwen2.5-32b-sim"
"""The simulator's default model name (``SimulatorConfig.model_name``); the gateway passes it through."""
SESSION_HEADER = "x-session-id"
"""The header the gateway reads its shopper (routing) key from (``GATEWAY_SHOPPER_KEY_HEADER``'s
default); aiperf puts one id per conversation in it."""


@dataclass(frozen=True)
class Workload:
    """What aiperf sends: multi-turn conversations whose history grows (aiperf threads each live answer
    into the next turn), at a Poisson rate."""

    conversations: int
    turns: int
    input_tokens: int
    """New user tokens per turn: a turn's prompt is the whole conversation so far plus these."""
    output_tokens: int
    seed: int = 0
    workers: int = 2
    """aiperf's worker processes: few, on a shared machine (its default is up to 3/4 of the cores)."""

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


@dataclass(frozen=True)
class Cell:
    policy: str
    rate: float
    """Requests per second, as aiperf's ``--request-rate`` (wall time)."""


def aiperf_argv(cli: str, url: str, cell: Cell, load: Workload, artifacts: str) -> list[str]:
    """The ``aiperf profile`` command of one cell, exactly as run."""
    return [
        cli, "profile",
        "--model", MODEL,
        "--tokenizer", TOKENIZER_NAME,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--session-header", SESSION_HEADER,
        "--use-server-token-count",
        "--conversation-num", str(load.conversations),
        "--conversation-turn-mean", str(load.turns),
        "--conversation-turn-stddev", "0",
        "--prompt-input-tokens-mean", str(load.input_tokens),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(load.output_tokens),
        "--prompt-output-tokens-stddev", "0",
        "--request-rate", f"{cell.rate:g}",
        "--random-seed", str(load.seed),
        "--workers-max", str(load.workers),
        "--record-processors", "1",
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--output-artifact-dir", artifacts,
    ]  # fmt: skip


def shown_command(cell: Cell, load: Workload) -> str:
    """The command as docs show it: the gateway's address as ``$GW``, artifacts in ``./artifacts``."""
    return shlex.join(aiperf_argv("aiperf", "GW_URL", cell, load, "artifacts")).replace("GW_URL", "$GW")


@contextlib.asynccontextmanager
async def gateway(urls: list[str], policy: str) -> AsyncIterator[str]:
    """``shopper router serve`` over ``urls`` with ``policy``, as a process; yields its base URL."""
    argv = [sys.executable, "-m", "shopper", "router", "serve", "--port", "0", "--policy", policy]
    for url in urls:
        argv += ["--endpoint", url]
    served = await start_served(argv, root=REPO)
    try:
        yield served.url
    finally:
        await served.stop()


async def run_cell(
    aiperf: AiperfInstall, cell: Cell, load: Workload, replicas: int, time_scale: float, timeout_s: float
) -> dict[str, Any]:
    """The cell's aiperf summary (its ``profile_export_aiperf.json``), with what produced it."""
    async with (
        SimulatorFleet(replicas, "--time-scale", str(time_scale)) as fleet,
        gateway(fleet.urls, cell.policy) as url,
    ):
        with tempfile.TemporaryDirectory(prefix="aiperf-") as artifacts:
            log = Path(artifacts) / "aiperf.out"
            with log.open("wb") as out:
                process = await asyncio.create_subprocess_exec(
                    *aiperf_argv(str(aiperf.cli), url, cell, load, artifacts),
                    cwd=artifacts, env=aiperf.env(), stdout=out, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
                try:
                    code = await asyncio.wait_for(process.wait(), timeout_s)
                except TimeoutError:
                    process.terminate()
                    await process.wait()
                    raise RuntimeError(f"aiperf ran past {timeout_s:.0f} s:\n{_tail(log)}") from None
            export = Path(artifacts) / "profile_export_aiperf.json"
            if code != 0 or not export.is_file():
                raise RuntimeError(f"aiperf exited {code}:\n{_tail(log)}")
            summary: dict[str, Any] = json.loads(export.read_text())
            summary["per_request"] = per_request(Path(artifacts) / "profile_export.jsonl")
    return summary


def per_request(export: Path) -> dict[str, list[float]]:
    """Each answered request's TTFT and ITL (ms) and turn, from aiperf's per-request export
    (``profile_export.jsonl``), in its order; errored requests carry no latencies and are left out."""
    columns: dict[str, list[float]] = {"ttft_ms": [], "itl_ms": [], "turn": []}
    for line in export.read_text().splitlines():
        record = json.loads(line)
        metrics = record.get("metrics") or {}
        if record.get("error") or "time_to_first_token" not in metrics:
            continue
        columns["ttft_ms"].append(float(metrics["time_to_first_token"]["value"]))
        columns["itl_ms"].append(float(metrics.get("inter_token_latency", {}).get("value", float("nan"))))
        columns["turn"].append(float(record["metadata"]["turn_index"]))
    return columns


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]
