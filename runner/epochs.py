"""Epochs: the unit in which the embedded runner makes progress durable.

An epoch is one poll of records, or one batch of fired timers. It records the next offset of every
partition it read and the session delta of every shopper it touched, and counts the prompts it launched
that have no stored result yet. Only a *completed prefix* of the log (every prompt's result stored, in
the order the epochs were opened) may become durable: that is what lets a crash replay from the last
commit without losing or reordering anything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runner.session_store import SessionDelta

TopicPartitionKey = tuple[str, int]


@dataclass(slots=True)
class Epoch:
    offsets: dict[TopicPartitionKey, int] = field(default_factory=dict)
    """Next offset to read per (topic, partition): what a commit of this epoch stores."""
    deltas: list[SessionDelta] = field(default_factory=list)
    pending: int = 0
    """Prompts launched in this epoch whose result is not stored yet."""
    lease: int = 0
    """The assignment's lease it was opened under (``runner.assignment``): an epoch of a lease that
    has ended is never saved or committed; the partitions' next owner replays it."""

    @property
    def complete(self) -> bool:
        return self.pending == 0


class EpochLog:
    """Closed epochs in the order they were opened."""

    def __init__(self) -> None:
        self._epochs: deque[Epoch] = deque()

    def __len__(self) -> int:
        return len(self._epochs)

    def append(self, epoch: Epoch) -> None:
        self._epochs.append(epoch)

    def take_completed_prefix(self) -> list[Epoch]:
        """Remove and return the epochs from the oldest up to the first incomplete one."""
        ready: list[Epoch] = []
        while self._epochs and self._epochs[0].complete:
            ready.append(self._epochs.popleft())
        return ready

    def all_complete(self) -> bool:
        return all(epoch.complete for epoch in self._epochs)

    def shoppers_in_flight(self) -> set[str]:
        """Shoppers whose deltas are not durable yet (their sessions must stay in memory)."""
        return {delta.shopper_id for epoch in self._epochs for delta in epoch.deltas}

    def clear(self) -> None:
        self._epochs.clear()


def merged_offsets(epochs: list[Epoch]) -> dict[TopicPartitionKey, int]:
    """The offsets a commit of ``epochs`` stores: the furthest of each partition."""
    merged: dict[TopicPartitionKey, int] = {}
    for epoch in epochs:
        for tp, offset in epoch.offsets.items():
            merged[tp] = max(merged.get(tp, 0), offset)
    return merged
