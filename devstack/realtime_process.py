"""``shopper realtime serve`` as a process of its own, for the tests and benchmarks that call it over
HTTP as an ad server would: started with its own settings, its address read from its ``READY`` line,
its output kept (and always read, so a chatty service never blocks on a full pipe), stopped with
SIGTERM as an operator stops it."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass
class RealtimeProcess:
    """A started service: its ``url`` (from ``READY http://host:port``) and every line it printed."""

    process: asyncio.subprocess.Process
    url: str
    lines: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

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
        if self._reader is not None:  # the rest of its output, up to EOF
            try:
                async with asyncio.timeout(timeout_s):
                    await self._reader
            except TimeoutError:
                self._reader.cancel()  # a child it started holds the pipe open: keep what was read
        return self.output


async def start_realtime_service(
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> RealtimeProcess:
    """``python -m shopper realtime serve --port 0 *args`` with ``env`` over this process's environment,
    from the checkout at ``root`` (another commit's, to compare; this interpreter's by default).
    Returns once it printed ``READY``; raises ``RuntimeError`` with its output if it exits before."""
    full_env = {**os.environ, **(env or {})}
    if root is not None:
        full_env["PYTHONPATH"] = str(root)
    command = [sys.executable, "-m", "shopper", "realtime", "serve", "--port", "0", *args]
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
    try:
        async with asyncio.timeout(ready_timeout_s):
            while True:
                line = (await process.stdout.readline()).decode(errors="replace")
                if not line:
                    raise RuntimeError("the service exited before READY:\n" + "".join(lines)[-4000:])
                lines.append(line)
                if line.startswith("READY "):
                    break
    except BaseException:
        if process.returncode is None:
            process.kill()
        await process.wait()
        raise
    service = RealtimeProcess(process, line.split()[1], lines)
    service._reader = asyncio.create_task(_keep_reading(process.stdout, lines))
    return service


@asynccontextmanager
async def realtime_service(
    args: Sequence[str] = (), env: Mapping[str, str] | None = None, root: Path | None = None
) -> AsyncIterator[RealtimeProcess]:
    """:func:`start_realtime_service` for the length of the block, stopped at its end."""
    service = await start_realtime_service(args, env, root)
    try:
        yield service
    finally:
        await service.stop()


async def _keep_reading(stream: asyncio.StreamReader, lines: list[str]) -> None:
    while line := await stream.readline():
        lines.append(line.decode(errors="replace"))
