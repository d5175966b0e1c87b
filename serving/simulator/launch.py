"""The one way to start simulator replicas as processes (the stack, tests, benchmarks, the local job).

A replica started with ``--port 0`` binds a free port and prints ``READY <url>`` once it serves; the
launchers here read that line, so no port is ever guessed or raced for. ``simulator_argv`` is the
command line every launcher (and ``devstack``'s detached ``spawn``) uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from serving.errors import SimulatorStartFailed

READY_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def simulator_argv(
    *, port: int = 0, replica_id: str = "r0", time_scale: float | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m serving.simulator`` with these settings (``extra``: any other CLI flags)."""
    argv = [sys.executable, "-m", "serving.simulator", "--port", str(port), "--replica-id", replica_id]
    if time_scale is not None:
        argv += ["--time-scale", str(time_scale)]
    return [*argv, *extra]


def options_flags(options: Path | None, role: str | None = None) -> tuple[str, ...]:
    """A replica's ``trtllm-serve`` options file, and its P/D role if any, as simulator flags (the
    names ``trtllm-serve`` takes), or none for the simulator's own defaults."""
    flags = ("--role", role) if role is not None else ()
    return flags if options is None else (*flags, "--extra-llm-api-options", str(options))


def _ready_url(line: str) -> str | None:
    return line.split()[1].strip() if line.startswith("READY ") else None


class SimulatorFleet:
    """``count`` replicas as child processes of this event loop; ``kill(i)`` simulates a crash.

    ``async with SimulatorFleet(3, "--time-scale", "0.01") as fleet: fleet.urls``
    """

    def __init__(self, count: int, *args: str) -> None:
        self.count = count
        self.args = args
        self.processes: list[asyncio.subprocess.Process] = []
        self.urls: list[str] = []
        self._drains: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SimulatorFleet:
        try:
            for i in range(self.count):
                argv = simulator_argv(replica_id=f"r{i}", extra=self.args)
                self.processes.append(
                    await asyncio.create_subprocess_exec(
                        *argv,
                        cwd=REPO_ROOT,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.DEVNULL,
                    )
                )
            for process in self.processes:
                self.urls.append(await self._wait_ready(process))
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _wait_ready(self, process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        async with asyncio.timeout(READY_TIMEOUT_S):
            while True:
                raw = await process.stdout.readline()
                if not raw:
                    raise SimulatorStartFailed(f"simulator exited with {await process.wait()} before READY")
                if url := _ready_url(raw.decode()):
                    self._drains.append(asyncio.create_task(_drain(process.stdout)))  # a full pipe blocks
                    return url

    def kill(self, i: int) -> None:
        self.processes[i].send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        for task in self._drains:
            task.cancel()
        for process in self.processes:
            if process.returncode is None:
                process.terminate()
        for process in self.processes:
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await stream.readline():
            pass


@contextlib.contextmanager
def simulator_replicas(
    count: int, *, time_scale: float = 0.01, extra: Sequence[str] = ()
) -> Iterator[list[str]]:
    """``count`` replicas for synchronous callers (the local Flink job); yields their base URLs.
    ``extra``: any other CLI flags (``--extra-llm-api-options``...)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(count):
            argv = simulator_argv(replica_id=f"r{i}", time_scale=time_scale, extra=extra)
            procs.append(
                subprocess.Popen(
                    argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            )
        yield [_wait_ready_sync(proc) for proc in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready_sync(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise SimulatorStartFailed(f"simulator exited with {proc.returncode} before READY")
            continue
        if url := _ready_url(line):
            return url
    raise TimeoutError("simulator did not print READY in time")
