"""The KV cache transceiver of a disaggregated replica: ``KvSender`` on a context replica, ``KvPuller`` on
a generation replica (see ``serving.simulator.disagg`` for the protocol and its guarantees).

Both ends are bounded like TensorRT-LLM's cache transceiver: a context replica sends at most
``kv_send_slots`` KV caches at once and a generation replica receives at most ``kv_recv_slots``; the rest
wait for a slot. A transfer lasts ``KvLink.transfer_ms(bytes)`` of simulated time (slept on the context
replica, scaled by ``time_scale`` like every simulated time); the held blocks are released when it ends,
so they stay pinned while they are being read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from serving.simulator.cost_model import KvLink, kv_cache_bytes
from serving.simulator.disagg import (
    KvCacheGone,
    KvTransferFailed,
    TransferReceipt,
    blocks_to_send,
)
from serving.simulator.engine import GenerationRequest
from serving.simulator.prefix_cache import BlockPrefixCache

PULL_PATH = "/internal/kv_transfer"
_CONNECT_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _HeldPrompt:
    pins: list[list[int]]
    hashes: frozenset[int]
    prompt_tokens: int
    timer: asyncio.TimerHandle | None = None


class KvSender:
    """A context replica's finished prompts waiting to be pulled, and the send side of the transfer."""

    def __init__(
        self,
        cache: BlockPrefixCache,
        link: KvLink,
        model_key: str,
        *,
        slots: int,
        timeout_s: float,
        time_scale: Callable[[], float],
        on_release: Callable[[], None],
    ) -> None:
        self._cache = cache
        self._link = link
        self._model_key = model_key
        self._slots = asyncio.Semaphore(slots)
        self._timeout_s = timeout_s
        self._time_scale = time_scale
        self._on_release = on_release
        self._held: dict[int, _HeldPrompt] = {}
        self.sent = 0
        self.expired = 0

    @property
    def pending(self) -> int:
        return len(self._held)

    def hold(self, job: GenerationRequest) -> None:
        """Keep a finished ``context_only`` prompt's pinned blocks until pulled or timed out."""
        assert job.ctx_request_id is not None
        held = _HeldPrompt(job.pins, frozenset(job.block_hashes), job.prompt_tokens)
        job.pins = []  # the sender owns the pins now
        scale = self._time_scale()
        wall = self._timeout_s * scale if scale > 0 else self._timeout_s
        held.timer = asyncio.get_running_loop().call_later(wall, self._expire, job.ctx_request_id)
        self._held[job.ctx_request_id] = held

    async def send(self, ctx_request_id: int, block_hashes: Sequence[int]) -> TransferReceipt:
        """Wait for a send slot, spend the transfer time, release the prompt's blocks. Raises
        ``KvCacheGone`` for an unknown id, or one that timed out while waiting for the slot."""
        if ctx_request_id not in self._held:
            raise KvCacheGone(f"context request {ctx_request_id} is not held here (pulled or timed out)")
        async with self._slots:
            held = self._held.pop(ctx_request_id, None)
            if held is None:
                raise KvCacheGone(f"context request {ctx_request_id} timed out waiting for a send slot")
            if held.timer is not None:
                held.timer.cancel()
            try:
                wanted = sum(1 for h in set(block_hashes) if h in held.hashes)
                blocks = blocks_to_send(wanted, held.prompt_tokens, self._cache.block_size)
                nbytes = kv_cache_bytes(blocks * self._cache.block_size, self._model_key)
                ms = self._link.transfer_ms(nbytes)
                await asyncio.sleep(ms / 1000.0 * self._time_scale())
            finally:
                self._release(held)
        self.sent += 1
        return TransferReceipt(ctx_request_id, blocks, nbytes, ms)

    def _expire(self, ctx_request_id: int) -> None:
        held = self._held.pop(ctx_request_id, None)
        if held is not None:
            self.expired += 1
            self._release(held)

    def _release(self, held: _HeldPrompt) -> None:
        for run in held.pins:
            self._cache.unpin(run)
        held.pins = []
        self._on_release()

    def close(self) -> None:
        for held in self._held.values():
            if held.timer is not None:
                held.timer.cancel()
            self._release(held)
        self._held.clear()


class KvPuller:
    """The receive side: ``slots`` bounds concurrent pulls; ``pull`` is one ``POST /internal/kv_transfer``."""

    def __init__(self, slots: int) -> None:
        self.slots = asyncio.Semaphore(slots)
        self._session: aiohttp.ClientSession | None = None
        self.received = 0
        self.gone = 0

    async def pull(self, ctx_url: str, ctx_request_id: int, block_hashes: Sequence[int]) -> TransferReceipt:
        """Pull the blocks of ``block_hashes`` (the ones this replica lacks). Raises ``KvCacheGone``
        when the context replica no longer holds them, ``KvTransferFailed`` when it cannot be asked."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S)
            self._session = aiohttp.ClientSession(timeout=timeout)
        body = {"ctx_request_id": ctx_request_id, "block_hashes": list(block_hashes)}
        try:
            async with self._session.post(ctx_url.rstrip("/") + PULL_PATH, json=body) as response:
                reply: Any = await response.json(content_type=None)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KvTransferFailed(f"KV pull from {ctx_url} failed: {exc!r}") from exc
        if status == 404:
            self.gone += 1
            message = (reply.get("error") or {}).get("message") if isinstance(reply, dict) else None
            raise KvCacheGone(message or f"{ctx_url} no longer holds context request {ctx_request_id}")
        if status != 200 or not isinstance(reply, dict):
            raise KvTransferFailed(f"KV pull from {ctx_url} answered {status}: {reply!r}")
        self.received += 1
        return TransferReceipt(
            ctx_request_id, int(reply["blocks"]), int(reply["bytes"]), float(reply["transfer_ms"])
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()
