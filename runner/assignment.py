"""What this member of the consumer group owns, as the rebalance callbacks leave it.

Written on the consumer thread (``on_assign``/``on_revoke`` run inside ``consume``), read on the
event loop. ``generation`` counts assignments and revocations: work started for one assignment (a
re-arm of its timers) checks it after every await and does nothing more once it has changed.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition


class Assignment:
    def __init__(self) -> None:
        self.partitions: list[TopicPartition] = []
        self.generation = 0

    def __bool__(self) -> bool:
        return bool(self.partitions)

    def numbers(self) -> list[int]:
        return sorted(tp.partition for tp in self.partitions)
