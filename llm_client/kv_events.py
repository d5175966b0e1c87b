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

Block hashes in the events are the *engine's* (TensorRT-LLM's ``BlockKeyHasher``; the simulator's
``serving.simulator.block_keys``), which a router cannot compute. ``EngineBlockMap`` rebuilds the
router's own chained hashes (``prompt_assembly.tokens.chain_block_hash``) from each stored block's
``tokens``, chained on the router hash of the event's ``parent_hash``, as NVIDIA Dynamo's router does
(it hashes each block's tokens and links blocks through the engine's parent hash).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from llm_client.endpoints import Endpoint
from prompt_assembly.tokens import ROOT_PARENT, chain_block_hash

if TYPE_CHECKING:
    from llm_client.routing.base import KvEventConsumer

log = logging.getLogger(__name__)


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


EngineHash = int | str
"""An engine's block hash: an integer in TensorRT-LLM's KV cache events (newer engines may write hex
strings); only ever compared, never computed here."""


class UniqueToken(_Event):
    token_id: int = Field(ge=0, lt=2**32)
    """A vocabulary id: the router packs it in 32 bits (``chain_block_hash``); a larger one raised out of
    the poller and ended it, with no log, and made the client's ``close`` raise before it closed the rest."""
    token_extra_id: int = 0
    """Nonzero for prompt-tuning or multimodal tokens, which a token-id hash cannot name."""


class StoredBlock(_Event):
    block_hash: EngineHash
    tokens: list[UniqueToken] = []


class StoredData(_Event):
    type: Literal["stored"]
    parent_hash: EngineHash | None = None
    blocks: list[StoredBlock]


class RemovedData(_Event):
    type: Literal["removed"]
    block_hashes: list[EngineHash]


class CreatedData(_Event):
    """First event of a (re)started engine (one per attention window's block pool)."""

    type: Literal["created"]
    num_blocks_per_cache_level: list[int] = []
    """Blocks of the pool per cache level: GPU first, then host offload."""


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
    window_size: int | None = None
    """The attention window of the block pool the event is about: a model with sliding-window layers
    has a pool, and events, per window size; only the largest (full attention) holds reusable
    prefixes (``PrefixAwarePolicy.apply_kv_events`` keeps those only, as Dynamo does)."""


EVENTS = TypeAdapter(list[KvCacheEvent])


def parse_events(raw: bytes) -> list[KvCacheEvent]:
    """One poll's answer; raises ``ValueError`` when it is not a list of known events."""
    try:
        return EVENTS.validate_json(raw)
    except ValidationError as exc:
        raise ValueError(f"not a KV cache event list: {exc.errors()[:1]}") from None


class EngineBlockMap:
    """One replica's engine block hashes and the router hashes rebuilt from their tokens.

    ``stored`` gives the router hashes of a stored run: block by block, the router hash of the block
    before (the event's ``parent_hash`` looked up here, the root when null) chained with the block's
    token ids. It stops at the first block it cannot rebuild: a parent it never saw stored (events
    missed in a gap, or stored before this router followed the replica), a partly filled block
    (TensorRT-LLM's partial reuse stores one as the last of a run; the router indexes whole blocks
    only, as Dynamo's does), or tokens with extra ids. ``removed`` gives the router hashes no engine
    block maps to any more (two salted copies of one prompt are two engine blocks with one router
    hash: it goes when both have). Bounded: beyond ``capacity`` entries (only reachable when removals
    were missed) the oldest mapping is forgotten.
    """

    __slots__ = ("_counts", "_router", "block_size", "capacity")

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._router: OrderedDict[EngineHash, int] = OrderedDict()
        self._counts: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._router)

    def router_hash(self, engine_hash: EngineHash) -> int | None:
        return self._router.get(engine_hash)

    def stored(self, parent_hash: EngineHash | None, blocks: Sequence[StoredBlock]) -> list[int]:
        parent = ROOT_PARENT if parent_hash is None else self._router.get(parent_hash)
        rebuilt: list[int] = []
        for block in blocks:
            tokens = block.tokens
            if parent is None or len(tokens) != self.block_size or any(t.token_extra_id for t in tokens):
                break
            known = self._router.get(block.block_hash)
            if known is None:
                known = chain_block_hash(parent, [t.token_id for t in tokens])
                self._router[block.block_hash] = known
                self._counts[known] += 1
            else:
                self._router.move_to_end(block.block_hash)
            rebuilt.append(known)
            parent = known
        while len(self._router) > self.capacity:
            self._forget(self._router.popitem(last=False)[1])
        return rebuilt

    def removed(self, engine_hashes: Sequence[EngineHash]) -> list[int]:
        gone: list[int] = []
        for engine_hash in engine_hashes:
            router = self._router.pop(engine_hash, None)
            if router is not None and self._forget(router):
                gone.append(router)
        return gone

    def clear(self) -> None:
        self._router.clear()
        self._counts.clear()

    def _forget(self, router: int) -> bool:
        """One engine block fewer maps to ``router``; True when none is left."""
        left = self._counts[router] - 1
        if left > 0:
            self._counts[router] = left
            return False
        del self._counts[router]
        return True


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
        self._polling: dict[str, asyncio.Task[None]] = {}
        """Each replica's poll under way: replicas are polled apart, so one that hangs (until the poll's
        timeout) does not hold the others' polls; one poll at a time per replica keeps its events in
        order."""
        self.polls = 0
        self.failed_polls = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="llm-kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        polls, self._polling = list(self._polling.values()), {}
        for running in (task, *polls):
            if running is not None:
                running.cancel()
        for running in (task, *polls):
            if running is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await running

    def events_off(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` said it publishes no events (its index is approximate)."""
        return self._off_until.get(endpoint.name, 0.0) > time.monotonic()

    async def poll_once(self) -> None:
        """One round over the routable replicas (also used by tests to step the poller)."""
        await asyncio.gather(*(self._poll(e) for e in self._endpoints() if e.routable))

    async def _run(self) -> None:
        """Every ``interval_s``, a poll of each routable replica whose last poll has ended. It waited for
        every replica's poll before the next round: one replica that stopped answering (a hung GPU, a
        stopped process, still routable until ejected) slowed every replica's polls to its 10 s timeout,
        so routing read a cache picture up to 40 times older than meant, and event buffers overflowed."""
        while True:
            started = time.monotonic()
            for endpoint in self._endpoints():
                running = self._polling.get(endpoint.name)
                if (error := _failure(running)) is not None:  # none expected: _poll counts its own
                    self.failed_polls += 1
                    log.warning("replica %s: KV cache event poll failed: %r", endpoint.name, error)
                if endpoint.routable and (running is None or running.done()):
                    self._polling[endpoint.name] = asyncio.create_task(
                        self._poll(endpoint), name=f"kv-events {endpoint.name}"
                    )
            names = {e.name for e in self._endpoints()}
            for name in [n for n, t in self._polling.items() if t.done() and n not in names]:
                del self._polling[name]  # a replica that left the fleet
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
            try:
                self._consumer.apply_kv_events(endpoint, events)
            except Exception as exc:  # one replica's events must not end the poller for every replica
                self.failed_polls += 1
                log.warning("replica %s: KV cache events not applied: %r", endpoint.name, exc)


def _failure(task: asyncio.Task[None] | None) -> BaseException | None:
    """The error a finished poll ended with (None: none, still running, or cancelled)."""
    if task is None or not task.done() or task.cancelled():
        return None
    return task.exception()
