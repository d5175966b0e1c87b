"""KV cache events in TensorRT-LLM's format, buffered for ``POST /kv_cache_events`` pollers.

``trtllm-serve`` with ``kv_cache_config.event_buffer_max_size > 0`` keeps the events of its block
manager in a bounded buffer; each ``POST /kv_cache_events`` drains it and answers a JSON list, each item
shaped as TensorRT-LLM's ``KVCacheEventSerializer`` writes it::

    {"event_id": 7, "window_size": 32768,
     "data": {"type": "stored", "parent_hash": 123 | null,
              "blocks": [{"type": "stored_block", "block_hash": 456,
                          "tokens": [{"type": "unique_token", "token_id": 9, "token_extra_id": 0}, ...],
                          "cache_level": 0, "priority": 35}]}}
    {"event_id": 8, "window_size": 32768, "data": {"type": "removed", "block_hashes": [456]}}
    {"event_id": 0, "window_size": 32768,
     "data": {"type": "created", "num_blocks_per_cache_level": [1848, 0]}}

Guarantees and deliberate differences:

- ``event_id`` counts up by one per event from 0 at start (the ``created`` event), so a consumer sees a
  *gap* when the bounded buffer dropped events it did not poll in time (the oldest go first, as in
  TensorRT-LLM), and sees ids start again from 0 with ``created`` after a restart;
- ``stored`` events carry one run of consecutive new blocks of one prompt, ``parent_hash`` being the
  block before the run (``null`` at the root); blocks a prompt reused are not stored again;
- ``removed`` carries the blocks LRU eviction dropped, in eviction order;
- ``cleared`` (``{"type": "cleared"}``) says every block is gone without a restart (the simulator's
  ``/admin/reset_cache`` on an idle replica; with requests in flight their pinned blocks stay, and the
  blocks it dropped come as one ``removed``). TensorRT-LLM has no such event (it reports removals); NVIDIA
  Dynamo's router has the same notion (``Cleared``). A consumer must treat it like ``created``: drop what
  it knows;
- block hashes are the engine's own (``serving.simulator.block_keys``, salted per ``cache_salt``), not
  the router's; each stored block carries its token ids in ``tokens``, from which a router rebuilds its
  own hashes (``llm_client.kv_events``), as it must in front of a real ``trtllm-serve``;
- ``window_size`` is the attention window of the cache the event is about: one full-attention window
  here, the replica's ``max_seq_len`` (TensorRT-LLM's default ``max_attention_window``). A model with
  sliding-window layers has one block pool, and one ``created`` event, per window size;
- ``lora_id`` is not written: the serializer read (``KVCacheEventSerializer`` in
  ``tensorrt_llm/_utils.py``) leaves it commented out.

Pure and synchronous: the prefix cache calls it under the event loop, the HTTP handler drains it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# TensorRT-LLM's default retention priority for reusable blocks.
DEFAULT_PRIORITY = 35


@dataclass(frozen=True, slots=True)
class _StoredRun:
    """A ``stored`` event as it came, serialised only when drained: the serialised form is a dict per
    token (about 1,500 for one uncached shopper prompt), and most of a buffer's events are dropped
    unread when nobody polls (every benchmark that runs no KV-event router), where building them was
    a quarter of a replica's CPU."""

    parent_hash: int | None
    block_hashes: tuple[int, ...]
    block_tokens: tuple[Sequence[int], ...]

    def serialised(self) -> dict[str, Any]:
        blocks = [
            {
                "type": "stored_block",
                "block_hash": h,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
                "cache_level": 0,
                "priority": DEFAULT_PRIORITY,
            }
            for h, tokens in zip(self.block_hashes, self.block_tokens, strict=True)
        ]
        return {"type": "stored", "parent_hash": self.parent_hash, "blocks": blocks}


class KvEventBuffer:
    """A bounded FIFO of events with consecutive ids; the oldest drop first when full. ``drain`` gives
    them serialised."""

    def __init__(self, max_size: int, *, window_size: int, capacity_blocks: int) -> None:
        if max_size < 1:
            raise ValueError("max_size must be positive (0 disables events: do not build a buffer)")
        self.max_size = max_size
        self.window_size = window_size
        self._events: deque[tuple[int, dict[str, Any] | _StoredRun]] = deque(maxlen=max_size)
        self._next_id = 0
        self.dropped = 0
        """Events lost because nobody drained the buffer in time (the consumer sees the id gap)."""
        self._append({"type": "created", "num_blocks_per_cache_level": [capacity_blocks, 0]})

    def __len__(self) -> int:
        return len(self._events)

    @property
    def last_event_id(self) -> int:
        return self._next_id - 1

    def stored(
        self, parent_hash: int | None, block_hashes: Sequence[int], block_tokens: Sequence[Sequence[int]]
    ) -> None:
        """One run of new consecutive blocks; ``block_tokens[i]`` are block i's token ids (kept until
        drained: the caller does not change them afterwards)."""
        if not block_hashes:
            return
        if len(block_hashes) != len(block_tokens):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_tokens)} blocks of tokens")
        self._append(_StoredRun(parent_hash, tuple(block_hashes), tuple(block_tokens)))

    def removed(self, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self._append({"type": "removed", "block_hashes": list(block_hashes)})

    def cleared(self) -> None:
        self._append({"type": "cleared"})

    def drain(self) -> list[dict[str, Any]]:
        """Every buffered event, oldest first, serialised; the buffer is empty afterwards."""
        window = self.window_size
        events = [
            {
                "event_id": event_id,
                "data": data.serialised() if isinstance(data, _StoredRun) else data,
                "window_size": window,
            }
            for event_id, data in self._events
        ]
        self._events.clear()
        return events

    def _append(self, data: dict[str, Any] | _StoredRun) -> None:
        if len(self._events) == self.max_size:
            self.dropped += 1
        self._events.append((self._next_id, data))
        self._next_id += 1
