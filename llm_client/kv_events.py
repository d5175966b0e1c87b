"""KV cache events from the replicas: TensorRT-LLM's event format, and the poller that feeds a policy.

``trtllm-serve`` (``kv_cache_config.event_buffer_max_size > 0``) and the simulator answer
``POST /kv_cache_events`` with the events buffered since the last poll, oldest first (see
``serving.simulator.kv_events`` for the shapes). Each poll drains the replica's buffer, so exactly one
poller may follow a replica. ``KvEventPoller`` polls every routable replica every ``interval_s`` and hands
each replica's events to the policy (``KvEventConsumer.apply_kv_events``), on the client's event loop.

Guarantees: events reach the policy in the order the replica produced them; a replica that answers 404
(events off) is polled again only every ``off_retry_s`` and the policy keeps its approximate belief for
it; a failed poll (replica down, timeout) is skipped, not retried in the loop (its events stay buffered
on the replica, or are dropped there and show up as an id gap). A poll is a drain: an answer the client
gave up on (timeout) is lost, and shows up as a gap at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from llm_client.endpoints import Endpoint
from llm_client.routing.base import KvEventConsumer

log = logging.getLogger(__name__)


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StoredBlock(_Event):
    block_hash: int


class StoredData(_Event):
    type: Literal["stored"]
    parent_hash: int | None = None
    blocks: list[StoredBlock]


class RemovedData(_Event):
    type: Literal["removed"]
    block_hashes: list[int]


class CreatedData(_Event):
    """First event of a (re)started engine."""

    type: Literal["created"]


class ClearedData(_Event):
    """Every block dropped without a restart (the simulator's cache reset; Dynamo's ``Cleared``)."""

    type: Literal["cleared"]


class UpdatedData(_Event):
    """A block's priority or cache level changed: no effect on what a router can reuse."""

    type: Literal["updated"]


EventData = Annotated[
    StoredData | RemovedData | CreatedData | ClearedData | UpdatedData, Field(discriminator="type")
]


class KvCacheEvent(_Event):
    event_id: int
    data: EventData


EVENTS = TypeAdapter(list[KvCacheEvent])


def parse_events(raw: bytes) -> list[KvCacheEvent]:
    """One poll's answer; raises ``ValueError`` when it is not a list of known events."""
    try:
        return EVENTS.validate_json(raw)
    except ValidationError as exc:
        raise ValueError(f"not a KV cache event list: {exc.errors()[:1]}") from None


class KvEventPoller:
    """Polls ``POST /kv_cache_events`` on each routable replica and feeds the policy."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoints: Callable[[], Sequence[Endpoint]],
        consumer: KvEventConsumer,
        interval_s: float,
        *,
        timeout_s: float = 10.0,
        off_retry_s: float = 30.0,
    ) -> None:
        self._session = session
        self._endpoints = endpoints
        self._consumer = consumer
        self.interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._off_retry_s = off_retry_s
        self._off_until: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.polls = 0
        self.failed_polls = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="llm-kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def events_off(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` said it publishes no events (its index is approximate)."""
        return self._off_until.get(endpoint.name, 0.0) > time.monotonic()

    async def poll_once(self) -> None:
        """One round over the routable replicas (also used by tests to step the poller)."""
        await asyncio.gather(*(self._poll(e) for e in self._endpoints() if e.routable))

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _poll(self, endpoint: Endpoint) -> None:
        if self.events_off(endpoint):
            return
        try:
            async with self._session.post(
                endpoint.url + "/kv_cache_events", timeout=self._timeout
            ) as response:
                if response.status == 404:
                    self._off_until[endpoint.name] = time.monotonic() + self._off_retry_s
                    log.info("replica %s publishes no KV cache events: approximate routing", endpoint.name)
                    return
                if response.status != 200:
                    self.failed_polls += 1
                    return
                raw = await response.read()
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            self.failed_polls += 1
            return
        try:
            events = parse_events(raw)
        except ValueError as exc:
            self.failed_polls += 1
            log.warning("replica %s: unreadable KV cache events: %s", endpoint.name, exc)
            return
        self.polls += 1
        if events:
            self._consumer.apply_kv_events(endpoint, events)
