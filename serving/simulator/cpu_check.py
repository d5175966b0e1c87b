"""How much CPU one simulator process spends per request: ``python -m serving.simulator.cpu_check``.

Starts a replica as a subprocess, by default at ``time_scale`` 0 (no sleeping: CPU-bound), drives it
with concurrent requests of a 3k-token prompt and 200 output tokens (``ignore_eos``), streaming and not,
and prints requests/s and the replica's CPU milliseconds per request (from ``/proc``, so Linux only).
The client runs in this process, so on a 2-core machine the two share the CPU; the per-request CPU
figure is the replica's own and does not depend on the client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from serving.simulator.launch import simulator_argv

_TICKS = os.sysconf("SC_CLK_TCK")
_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    mode: str
    requests: int
    wall_s: float
    server_cpu_s: float

    def row(self) -> str:
        return (
            f"| {self.mode:10} | {self.requests:8d} | {self.requests / self.wall_s:8.1f} "
            f"| {1000 * self.server_cpu_s / self.requests:12.2f} | {self.server_cpu_s / self.wall_s:9.2f} |"
        )


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _prompt(rng: random.Random, tokens: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(" " + "".join(rng.choices(letters, k=5)) for _ in range(tokens))


async def _drive(url: str, prompts: list[str], concurrency: int, stream: bool, output_tokens: int) -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:
            while not queue.empty():
                body = {"prompt": queue.get_nowait(), "max_tokens": output_tokens, "ignore_eos": True}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for _ in response.content.iter_any():
                        pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def main(args: argparse.Namespace) -> None:
    proc = await asyncio.create_subprocess_exec(
        *simulator_argv(replica_id="cpu-check", time_scale=args.time_scale),
        cwd=_REPO,
        env={**os.environ, "PYTHONPATH": str(_REPO)},
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    await proc.stdout.readline()  # config
    url = (await proc.stdout.readline()).decode().split()[1]
    rng = random.Random(0)
    try:
        await _drive(url, [_prompt(rng, args.prompt_tokens) for _ in range(8)], 4, False, 4)  # warm-up
        results = []
        for stream in (False, True):
            prompts = [_prompt(rng, args.prompt_tokens) for _ in range(args.requests)]
            cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
            await _drive(url, prompts, args.concurrency, stream, args.output_tokens)
            wall, cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0
            results.append(Result("stream" if stream else "non-stream", args.requests, wall, cpu))
    finally:
        proc.terminate()
        await proc.wait()
    print(
        f"prompt {args.prompt_tokens} tokens, {args.output_tokens} output tokens, "
        f"concurrency {args.concurrency}, time_scale {args.time_scale}, {os.cpu_count()} CPUs"
    )
    print("| mode       | requests |    req/s | server CPU ms/req | CPU cores |")
    print("|------------|----------|----------|-------------------|-----------|")
    for r in results:
        print(r.row())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument(
        "--time-scale", type=float, default=0.0, help="0: CPU-bound; >0: paced by the GPU model"
    )
    asyncio.run(main(parser.parse_args()))
