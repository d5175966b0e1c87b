"""The one replica pool shared by real-time and batch, and how each side follows the live split.

``SharedPool`` is the definition: the replicas, in a fixed order. The split is one number, how many
replicas real-time holds: real-time takes them from the front of the list, batch the rest, so a
change moves the boundary and never reshuffles replicas that stay. The capacity shifter publishes the
split in Redis (``PoolBoard``, one hash per pool); every process serving either side follows it with a
``PoolFollower`` that re-points its LLM client.

Hand-over: a replica going from batch to real-time is dropped by batch at once but joins real-time
only ``handoff_s`` after the change; batch calls still running on it a second before that
(``ABORT_NOTICE_S``) are cut and moved to a replica batch kept (``LLMClient.set_endpoints``'s
``withdraw_after_s``), so real-time calls do not queue behind them. A replica going back to batch
moves at once (batch does not mind a few real-time stragglers).

Lease: the split is published with a TTL (``lease_s``) that the shifter renews on every tick, so a
shifter that stops or crashes cannot hold replicas forever. Once the key lapses, batch takes the whole
pool; real time keeps its last split (its own shifter, if alive, publishes again). A split published
where none is in force (a first start, or a restart after a lapse) has no hand-off: its real-time
replicas join at once, and batch, which held the whole pool meanwhile, cuts its calls on them at once.
The count real time held is remembered beside the split for a while longer (``held_remembered_s``), so
a restart that outlasted the lease resumes from it rather than from the floor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import orjson
import redis.asyncio as aioredis

from capacity.background import BackgroundLoop, every
from prompt_assembly.errors import ConfigurationError
from sinks.keys import RedisKeys

log = logging.getLogger(__name__)

Side = Literal["realtime", "batch"]

ABORT_NOTICE_S = 1.0
"""How long a replica may take to notice a closed request and free its slot: trtllm-serve polls a
non-streamed request's connection every second (the simulator does the same). Measured
(``bench/handoff.py``): cut at the join itself, the first real-time calls there waited up to 2.6 s for
the poll and the running iteration."""


@dataclass(frozen=True, slots=True)
class PoolSplit:
    """A published split: ``realtime`` replicas from the front of ``replicas``, batch the rest."""

    replicas: tuple[str, ...]
    realtime: int
    previous_realtime: int
    changed_at: float
    version: int
    moved_at: tuple[float | None, ...] = ()
    """When each real-time replica left batch (None: held since the first split). Per replica, because
    on a steep ramp a newer split is published while an older one's newcomers are still handing off."""
    handoff_s: float | None = None
    """The shifter's hand-off, which both sides follow (None: published before it was; each side's
    own setting)."""

    def urls(self, side: Side, now: float, handoff_s: float) -> list[str]:
        """The replicas ``side`` should route to at ``now``: real-time skips newcomers still draining
        batch calls (joins are appended at the back, so this is a prefix)."""
        if side == "batch":
            return list(self.replicas[self.realtime :])
        held = self.replicas[: self.realtime]
        joins = zip(held, self.join_times(), strict=True)
        return [url for url, moved in joins if moved is None or now >= moved + handoff_s]

    def joins_real_time_at(self, url: str, handoff_s: float) -> float | None:
        """When real time starts routing to ``url`` (None: it is not a real-time replica; a replica
        held since the first split joined at once, at ``changed_at``)."""
        held = self.replicas[: self.realtime]
        if url not in held:
            return None
        moved = self.join_times()[held.index(url)]
        return self.changed_at if moved is None else moved + handoff_s

    def join_times(self) -> tuple[float | None, ...]:
        """``moved_at``, or for a split published without it, what its one change implies."""
        if len(self.moved_at) == self.realtime:
            return self.moved_at
        kept = min(self.previous_realtime, self.realtime)
        return (None,) * kept + (self.changed_at,) * (self.realtime - kept)


def _next_join_times(current: PoolSplit | None, realtime: int, now: float) -> tuple[float | None, ...]:
    """Replicas staying on real-time keep their join time (a still-running hand-off goes on); newcomers
    join from ``now``."""
    if current is None:
        return (None,) * realtime
    kept = current.join_times()[:realtime]
    return kept + (now,) * (realtime - len(kept))


class SharedPool:
    """The pool definition: replica URLs in a fixed order, and its name (the Redis key)."""

    def __init__(self, name: str, replicas: Sequence[str]) -> None:
        if not replicas:
            raise ConfigurationError("a pool needs at least one replica")
        self.name = name
        self.replicas = tuple(u.rstrip("/") for u in replicas)


class PoolBoard:
    """The published split in Redis: ``{prefix}pool:{name}`` (JSON; ``moved_at`` absent in splits
    published before per-replica join times, which read as their one change implies).

    ``handoff_s``: published with the split, so that both sides hand a replica over at the same
    instant whatever their own settings say. ``lease_s``: how long a published split stays in force
    unless published again (the key's TTL);
    None publishes without expiry (a fixed split, or a board only read from). ``held_remembered_s``
    (with a lease): how long the count real time held outlives the last renewal (``remembered``), so
    that a real-time service restarted after its split lapsed resumes from it, not from its floor."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        pool: SharedPool,
        *,
        lease_s: float | None = None,
        held_remembered_s: float | None = None,
        handoff_s: float | None = None,
    ) -> None:
        self.redis = redis
        self.handoff_s = handoff_s
        self.pool = pool
        keys = RedisKeys(prefix)
        self.key = keys.pool(pool.name)
        self.held_key = keys.pool_held(pool.name)
        self.lease_ms = None if lease_s is None else max(1, round(lease_s * 1000))
        remembered = held_remembered_s if held_remembered_s is not None else lease_s
        self.held_ms = None if remembered is None or lease_s is None else max(1, round(remembered * 1000))

    async def publish(self, realtime: int, now: float | None = None) -> PoolSplit:
        """Publish ``realtime`` and start a new lease. An unchanged split is only renewed (its
        version and join times stay); one that lapsed meanwhile is published as on a first start."""
        current = await self.read()
        if (
            current is not None
            and current.realtime == realtime
            and current.replicas == self.pool.replicas
            and current.handoff_s == self.handoff_s
        ):
            if self.lease_ms is None or await self.renew():
                return current
            current = None  # lapsed between the read and the renewal
        changed_at = time.time() if now is None else now
        split = PoolSplit(
            replicas=self.pool.replicas,
            realtime=realtime,
            previous_realtime=current.realtime if current is not None else realtime,
            changed_at=changed_at,
            version=(current.version + 1) if current is not None else 1,
            moved_at=_next_join_times(current, realtime, changed_at),
            handoff_s=self.handoff_s,
        )
        payload = {
            "replicas": list(split.replicas),
            "realtime": split.realtime,
            "previous_realtime": split.previous_realtime,
            "changed_at": split.changed_at,
            "version": split.version,
            "moved_at": list(split.moved_at),
            "handoff_s": split.handoff_s,
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.key, orjson.dumps(payload), px=self.lease_ms)
            if self.held_ms is not None:
                pipe.set(self.held_key, realtime, px=self.held_ms)
            await pipe.execute()
        return split

    async def renew(self) -> bool:
        """Restart the published split's lease; False when none is in force (never published, or
        lapsed: then only ``publish`` brings one back)."""
        if self.lease_ms is None:
            return bool(await self.redis.exists(self.key))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(self.key, self.lease_ms)
            if self.held_ms is not None:
                pipe.pexpire(self.held_key, self.held_ms)
            renewed, *_ = await pipe.execute()
        return bool(renewed)

    async def remembered(self) -> int | None:
        """How many replicas real time held in the last split published under a lease, for
        ``held_remembered_s`` after its last renewal (None: no such split, or remembered no more)."""
        raw = await self.redis.get(self.held_key)
        return None if raw is None else int(raw)

    async def read(self) -> PoolSplit | None:
        raw = await self.redis.get(self.key)
        if raw is None:
            return None
        data = orjson.loads(raw)
        return PoolSplit(
            replicas=tuple(data["replicas"]),
            realtime=int(data["realtime"]),
            previous_realtime=int(data["previous_realtime"]),
            changed_at=float(data["changed_at"]),
            version=int(data["version"]),
            moved_at=tuple(None if t is None else float(t) for t in data.get("moved_at", ())),
            handoff_s=None if data.get("handoff_s") is None else float(data["handoff_s"]),
        )


class Repoint(Protocol):
    """How a follower re-points its side's client (``LLMClient.set_endpoints``, the batch pool's)."""

    def __call__(self, urls: list[str], *, withdraw_after_s: Mapping[str, float] | None = None) -> None: ...


class PoolFollower:
    """Polls the board and applies this side's replicas through ``apply`` when they change.

    With no split in force (its lease lapsed: the real-time shifter is gone), batch takes the whole
    pool and real time keeps its last split. A read that fails keeps the last split on either side."""

    def __init__(
        self,
        board: PoolBoard,
        side: Side,
        apply: Repoint,
        *,
        poll_s: float = 0.5,
        handoff_s: float = 2.0,
        abort_notice_s: float = ABORT_NOTICE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``handoff_s``: for a split published without the shifter's own. ``clock``: wall seconds, the
        shifter's clock (the split's ``changed_at`` is in it). Batch's ``apply`` is told to withdraw the
        calls still running on the replicas it loses ``abort_notice_s`` before real time starts routing
        to them, so that the replicas have noticed and freed their slots by then."""
        self.board = board
        self.clock = clock
        self.side = side
        self.apply = apply
        self.poll_s = poll_s
        self.handoff_s = handoff_s
        self.abort_notice_s = abort_notice_s
        self.current: list[str] | None = None
        # A Redis hiccup keeps the last split in force; the next poll tries again.
        what = f"pool follower ({side})"
        self._loop = BackgroundLoop(
            f"pool-follower-{side}", lambda: every(lambda: self.poll_s, self.sync, log, what)
        )

    async def sync(self) -> list[str] | None:
        split = await self.board.read()
        if split is None:
            return self.current if self.side == "realtime" else self._take_whole_pool()
        now = self.clock()
        handoff_s = split.handoff_s if split.handoff_s is not None else self.handoff_s
        urls = split.urls(self.side, now, handoff_s)
        if urls != self.current:
            log.info("%s pool now %d replica(s) (split v%d)", self.side, len(urls), split.version)
            withdrawals = self._withdrawals(split, urls, now, handoff_s) if self.side == "batch" else None
            self.current = urls
            self.apply(urls, withdraw_after_s=withdrawals)
        return urls

    def _withdrawals(
        self, split: PoolSplit, urls: list[str], now: float, handoff_s: float
    ) -> dict[str, float]:
        """How long batch's calls on each replica it loses may still run: until ``abort_notice_s``
        before real time takes it (at once if that has passed, or if batch learns late). None are cut
        when batch keeps no replica: its calls would have nowhere to go and fail at their deadline, so
        they finish where they are (real time shares the replica with them until they end)."""
        if not urls:
            return {}
        lost = [url for url in self.current or () if url not in urls]
        joins = {url: split.joins_real_time_at(url, handoff_s) for url in lost}
        return {url: max(0.0, at - self.abort_notice_s - now) for url, at in joins.items() if at is not None}

    def _take_whole_pool(self) -> list[str]:
        urls = list(self.board.pool.replicas)
        if urls != self.current:
            why = (
                "the split's lease lapsed (the real-time shifter is gone)"
                if self.current is not None
                else "no split in force (no real-time shifter has published one, or its lease lapsed)"
            )
            log.warning(
                "batch pool now all %d replica(s) of pool %s: %s", len(urls), self.board.pool.name, why
            )
            self.current = urls
            self.apply(urls)
        return urls

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
