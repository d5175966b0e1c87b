"""The shopper sessions the embedded runner holds in memory, and the partition each came from.

The cache is bounded by ``session_cache_size``: ``evict`` drops idle sessions, the least recently used
first, until it fits. A session the runner still needs is never dropped: one whose delta is in an epoch
not yet durable (the caller says which), one with unsaved changes, one with a pending trigger (its
timer needs it), and one *pinned* by the poll being processed (``pinned``).

Why pins: a poll's shoppers not in memory are loaded from the store, and that load awaits; a durable
point running meanwhile evicted a shopper of the same poll that was in memory and idle, and the poll
then started that shopper blank at seq 0: its header overwrote the stored one and its next prompts
reused old ``request_id`` s (tests/runner/test_session_load_eviction.py). And why last use: eviction
by first load sent the longest-active shoppers first, the ones most likely to come back.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from prompt_assembly.session import ShopperSession


class SessionCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[str, ShopperSession] = OrderedDict()
        """Least recently used first."""
        self._partition_of: dict[str, int] = {}
        """The partition of each session in ``_sessions`` (and of no other): bounded with it."""
        self._pins: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, shopper_id: object) -> bool:
        return shopper_id in self._sessions

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)

    def __getitem__(self, shopper_id: str) -> ShopperSession:
        return self._sessions[shopper_id]

    def get(self, shopper_id: str) -> ShopperSession | None:
        return self._sessions.get(shopper_id)

    @property
    def lookup(self) -> Callable[[str], ShopperSession | None]:
        """``get`` without the method call around it, for a loop over a poll's events (it does not
        count as a use: the poll's ``close_epoch`` touches every session it used)."""
        return self._sessions.get

    def items(self) -> list[tuple[str, ShopperSession]]:
        return list(self._sessions.items())

    @property
    def partition_map(self) -> Mapping[str, int]:
        """Shopper -> partition, for the sessions held (read-only view)."""
        return self._partition_of

    def partition_of(self, shopper_id: str) -> int:
        return self._partition_of.get(shopper_id, 0)

    def missing(self, shopper_ids: Iterable[str]) -> list[str]:
        """Those of ``shopper_ids`` (once each) not held in memory."""
        return [sid for sid in dict.fromkeys(shopper_ids) if sid not in self._sessions]

    def use(self, shopper_id: str, partition: int, new: Callable[[str], ShopperSession]) -> ShopperSession:
        """The session an event of ``shopper_id`` (read from ``partition``) is applied to; a new one
        from ``new`` when none is held."""
        session = self._sessions.get(shopper_id)
        if session is None:
            session = self._sessions[shopper_id] = new(shopper_id)
        else:
            self._sessions.move_to_end(shopper_id)
        self._partition_of[shopper_id] = partition
        return session

    def touch(self, shopper_id: str) -> None:
        """``shopper_id`` was just used (a trigger fired): it goes last in the eviction order."""
        if shopper_id in self._sessions:
            self._sessions.move_to_end(shopper_id)

    @contextmanager
    def pinned(self, shopper_ids: Iterable[str]) -> Iterator[None]:
        """While inside, ``evict`` leaves these shoppers' sessions (held now or adopted meanwhile) in
        memory. Pins nest: a shopper pinned twice stays until both are released."""
        pins = set(shopper_ids)
        self._pins.update(pins)
        try:
            yield
        finally:
            self._pins.subtract(pins)
            for sid in pins:
                if self._pins[sid] <= 0:
                    del self._pins[sid]

    def place(self, shopper_id: str, partition: int) -> None:
        """Record the partition of a held session (a re-armed timer's)."""
        self._partition_of[shopper_id] = partition

    def place_many(self, partitions: Mapping[str, int]) -> None:
        """Record the partition of held sessions: once per shopper a poll touched (the partition of its
        last record), where ``use`` records it per event."""
        self._partition_of.update(partitions)

    def adopt(self, loaded: dict[str, ShopperSession]) -> None:
        """Sessions loaded from the store, for shoppers not in memory *now*: a load awaits, and the
        other loader (ingest or re-arming timers after an assignment) may have loaded the same shopper
        and applied events to it meanwhile. Replacing that session with the stale copy lost those
        events' changes (prompts went missing after a rebalance: the rebalance case of
        tests/faults/test_faults.py)."""
        for sid, session in loaded.items():
            self._sessions.setdefault(sid, session)

    def evict(self, busy: set[str]) -> int:
        """Bring the sessions held down to ``capacity``, the least recently used first, with their
        partition entries; returns how many went. A session in ``busy`` (its delta is in an epoch not
        yet durable), pinned, with unsaved changes or with a pending trigger stays. Busy sessions are skipped,
        not stopped at, so the cache stays above the bound only when every session left is busy."""
        excess = len(self._sessions) - self.capacity
        if excess <= 0:
            return 0
        idle: list[str] = []
        for sid, session in self._sessions.items():
            if sid not in busy and sid not in self._pins and not session.dirty and session.pending is None:
                idle.append(sid)
                if len(idle) == excess:
                    break
        for sid in idle:
            del self._sessions[sid]
            self._partition_of.pop(sid, None)
        return len(idle)

    def clear(self) -> None:
        self._sessions.clear()
        self._partition_of.clear()
