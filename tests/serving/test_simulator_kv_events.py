"""serving.simulator.kv_events: the buffer keeps a stored run as it came and serialises it when drained;
what a poller reads is TensorRT-LLM's format, ids and drops as before."""

from __future__ import annotations

import orjson
import pytest

from serving.simulator.kv_events import DEFAULT_PRIORITY, KvEventBuffer


def test_a_drain_reads_each_event_in_trtllms_format_with_consecutive_ids() -> None:
    events = KvEventBuffer(8, window_size=32768, capacity_blocks=1848)
    tokens = [[1, 2], [3, 4]]
    events.stored(None, [11, 12], tokens)
    events.stored(12, [13], [[5, 6]])
    events.removed([11])
    events.cleared()
    drained = orjson.loads(orjson.dumps(events.drain()))

    def block(h: int, ids: list[int]) -> dict[str, object]:
        toks = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]
        return {
            "type": "stored_block", "block_hash": h, "tokens": toks, "cache_level": 0,
            "priority": DEFAULT_PRIORITY,
        }  # fmt: skip

    assert drained == [
        {"event_id": 0, "window_size": 32768,
         "data": {"type": "created", "num_blocks_per_cache_level": [1848, 0]}},
        {"event_id": 1, "window_size": 32768,
         "data": {"type": "stored", "parent_hash": None, "blocks": [block(11, [1, 2]), block(12, [3, 4])]}},
        {"event_id": 2, "window_size": 32768,
         "data": {"type": "stored", "parent_hash": 12, "blocks": [block(13, [5, 6])]}},
        {"event_id": 3, "window_size": 32768, "data": {"type": "removed", "block_hashes": [11]}},
        {"event_id": 4, "window_size": 32768, "data": {"type": "cleared"}},
    ]  # fmt: skip
    assert events.drain() == [] and events.last_event_id == 4


def test_a_full_buffer_drops_the_oldest_and_the_ids_show_the_gap() -> None:
    events = KvEventBuffer(3, window_size=64, capacity_blocks=10)
    for h in range(5):
        events.stored(None, [h], [[h]])
    drained = events.drain()
    assert [e["event_id"] for e in drained] == [3, 4, 5]
    assert [e["data"]["blocks"][0]["block_hash"] for e in drained] == [2, 3, 4]
    assert events.dropped == 3


def test_a_run_whose_hashes_and_tokens_differ_in_length_is_refused_when_stored() -> None:
    events = KvEventBuffer(3, window_size=64, capacity_blocks=10)
    with pytest.raises(ValueError, match="2 block hashes for 1 blocks"):
        events.stored(None, [1, 2], [[1]])
