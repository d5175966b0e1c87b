"""A service of ours as a process of its own, for the tests and benchmarks that call it over HTTP: every
one of them (``shopper realtime serve``, ``shopper router serve``, the simulator) prints
``READY http://host:port`` once it listens. Started with its own settings, its address read from that
line, its output kept (and always read, so a chatty service never blocks on a full pipe), stopped with
SIGTERM as an operator stops it."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass
class ServedProcess:
    """A started service: its ``url`` (from ``READY http://host:port``) and every line it printed."""

    process: asyncio.subprocess.Process
    url: str
    lines: list[str]
    reader: asyncio.Task[None]
    """Reads its output into ``lines`` until it closes."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> str:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; returns all it printed."""
        if self.process.returncode is None:
            self.process.terminate()
            try:
                async with asyncio.timeout(timeout_s):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        try:  # the rest of its output, up to EOF
            async with asyncio.timeout(timeout_s):
                await self.reader
        except TimeoutError:
            self.reader.cancel()  # a child it started holds the pipe open: keep what was read
        return self.output


async def start_served(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> ServedProcess:
    """``command`` with ``env`` over this process's environment, from the checkout at ``root`` (another
    commit's, to compare; this interpreter's by default). Returns once it printed ``READY``; raises
    ``RuntimeError`` with its output if it exits before."""
    full_env = {**os.environ, **(env or {})}
    if root is not None:
        full_env["PYTHONPATH"] = str(root)
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=root,
        env=full_env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    reader = asyncio.create_task(_read(process.stdout, lines, ready))
    try:
        async with asyncio.timeout(ready_timeout_s):
            url = await ready
    except BaseException:
        if process.returncode is None:
            process.kill()
        await process.wait()
        reader.cancel()
        raise
    return ServedProcess(process, url, lines, reader)


async def start_realtime_service(
    args: Sequence[str] = (), env: Mapping[str, str] | None = None, root: Path | None = None
) -> ServedProcess:
    """``shopper realtime serve --port 0 *args``: :func:`start_served`."""
    command = [sys.executable, "-m", "shopper", "realtime", "serve", "--port", "0", *args]
    return await start_served(command, env, root)


@asynccontextmanager
async def realtime_service(
    args: Sequence[str] = (), env: Mapping[str, str] | None = None, root: Path | None = None
) -> AsyncIterator[ServedProcess]:
    """:func:`start_realtime_service` for the length of the block, stopped at its end."""
    service = await start_realtime_service(args, env, root)
    try:
        yield service
    finally:
        await service.stop()


async def _read(stream: asyncio.StreamReader, lines: list[str], ready: asyncio.Future[str]) -> None:
    """Every line into ``lines``; ``ready`` gets the address of the first ``READY`` line, or an error
    naming what was printed if the output ends before one."""
    while raw := await stream.readline():
        line = raw.decode(errors="replace")
        lines.append(line)
        if not ready.done() and line.startswith("READY "):
            ready.set_result(line.split()[1])
    if not ready.done():
        ready.set_exception(RuntimeError("the service exited before READY:\n" + "".join(lines)[-4000:]))
