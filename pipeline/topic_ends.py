"""Where a Kafka partition ends, and how far a consumer group is from it.

A partition's end (its high watermark) reaches a client two ways: the broker's ListOffsets(latest)
answer, and the high watermark every fetch response carries. On Apache Kafka they agree. Tansu 0.6.0,
the embedded broker, answers ListOffsets with the base offset of the partition's last *batch* plus one,
so a batch of 300 records reads as an end of 1, while its fetch responses are right. An until-drained
runner that trusted ListOffsets alone saw a lag of 0 with records still unread and ended early; after a
broker restart, when some partitions are fetched late, that lost the tails of two partitions (the
fault suite's broker case). The end used here is the larger of the two, so a broker wrong in
either answer can only make a reader wait, never stop early.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import Consumer, TopicPartition


def end_offset(consumer: Consumer, partition: TopicPartition, timeout_s: float = 5.0) -> int:
    """The partition's end: the larger of the broker's ListOffsets answer and the high watermark of
    this consumer's last fetch response for it (-1001, i.e. none, until it has fetched)."""
    _, listed = consumer.get_watermark_offsets(partition, timeout=timeout_s, cached=False)
    _, fetched = consumer.get_watermark_offsets(partition, cached=True)
    return max(listed, fetched)


def topic_lag(consumer: Consumer, topic: str, assignment: Iterable[TopicPartition]) -> int:
    """Records not yet processed in *any* partition of ``topic``: the consumer's own partitions
    (``assignment``) by its position, the others by the group's committed offset. A partition of its
    own that it has not consumed from since it was assigned has no position: it counts from 0 until a
    fetch answer for it came (so a partition fetched late is never taken for done), and from the
    group's committed offset after that (a partition another member finished yields no record, hence
    never a position, and must not keep an until-drained runner waiting for good). For partitions it
    does not fetch, only the broker's ListOffsets is known (on Tansu, a batch's base offset + 1): a
    member that died keeping its partitions counts while it has committed nothing of them, and the
    whole topic being done is what "drained" means."""
    metadata = consumer.list_topics(topic, timeout=5).topics[topic]
    everything = [TopicPartition(topic, p) for p in metadata.partitions]
    done = {tp.partition: tp.offset for tp in consumer.committed(everything, timeout=5)}
    for own in consumer.position(list(assignment)):
        if own.offset >= 0:
            done[own.partition] = own.offset
        elif consumer.get_watermark_offsets(own, cached=True)[1] < 0:
            done[own.partition] = 0  # not fetched since it was assigned: nothing is known done
        # else fetched, and nothing consumed: the group's committed offset stands (records fetched
        # but not yet consumed are above it, so they still count)
    return sum(max(0, end_offset(consumer, tp) - max(done.get(tp.partition, 0), 0)) for tp in everything)
