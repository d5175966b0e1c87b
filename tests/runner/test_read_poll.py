"""A poll's bookkeeping: the runner reads the events topic and the repartition topic, and is assigned
partition p of both, so one poll can hold partition 0 of each. Each topic's offset must be kept; keyed by
partition number alone, the topic read first in a poll was left out of its epoch's offsets."""

from __future__ import annotations

from confluent_kafka import Message

from runner.ingest import read_poll


def test_a_poll_holding_partition_0_of_both_topics_keeps_both_offsets() -> None:
    messages = [
        *(
            Message(topic="events", partition=0, offset=o, value=b"e", timestamp=(1, o))
            for o in range(100, 103)
        ),
        Message(topic="events", partition=1, offset=7, value=b"f", timestamp=(1, 7)),
        Message(topic="events.g.repartition", partition=0, offset=10, value=b"c", timestamp=(1, 10)),
    ]
    offsets: dict[tuple[str, int], int] = {}
    values, stamps, partitions = read_poll(messages, "events", offsets)
    assert offsets == {("events", 0): 103, ("events", 1): 8, ("events.g.repartition", 0): 11}
    assert values == [b"e", b"e", b"e", b"f", b"c"]
    assert stamps == [(1, 100), (1, 101), (1, 102), (1, 7), (1, 10)]
    assert partitions == [0, 0, 0, 1, 0]
