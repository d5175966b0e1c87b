"""A shopper's answer survives the loss of their session state: the version is ``(session_epoch, seq)``,
so a session started again after its state was lost writes new request ids whose answers replace the
lost session's in the real Redis at once (before, seq restarted at 1 and the stale answer stayed for
the signal TTL), and the reset is counted, on the sink and in the shopper's hash."""

from __future__ import annotations

import time

from prompt_assembly.events import ShopperEvent
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import PromptRequest, ShopperInsight, Usage
from prompt_assembly.session import ShopperSession
from prompt_assembly.understanding import ShopperUnderstanding
from sinks.redis import RedisSignalSink
from tests.conftest import Isolated

START_TS = 1_764_000_000.0


def cart_add(event_id: str, ts: float, shopper: str = "s1") -> ShopperEvent:
    product = {"product_id": "p1", "title": "Witch Hat", "price": 9.5}
    return ShopperEvent.model_validate(
        {"event_id": event_id, "shopper_id": shopper, "type": "add_to_cart", "ts": ts, "product": product}
    )


def answer(prompt: PromptRequest) -> ShopperInsight:
    """The insight a replica would return for ``prompt``: its summary names the request."""
    summary = f"answer to {prompt.request_id}"
    return ShopperInsight(
        request_id=prompt.request_id,
        shopper_id=prompt.shopper_id,
        session_epoch=prompt.session_epoch,
        seq=prompt.seq,
        reason=prompt.reason,
        understanding=ShopperUnderstanding(
            interests=["hats"], occasion=None, style="fun", price_sensitivity="low", summary=summary
        ),
        text=summary,
        model="m",
        replica="r0",
        usage=Usage(),
        event_count=prompt.event_count,
        new_event_ids=prompt.new_event_ids,
        last_event_ts=prompt.last_event_ts,
        ttft_ms=1,
        latency_ms=1,
        attempts=1,
        produced_at=time.time(),
    )


def prompts_for(
    processor: SessionProcessor, session: ShopperSession, first: int, count: int
) -> list[PromptRequest]:
    interval = processor.config.triggers.min_prompt_interval_s
    prompts: list[PromptRequest] = []
    for i in range(first, first + count):
        prompts += processor.apply(session, cart_add(f"e{i}", START_TS + i * 2 * interval)).prompts
    return prompts


async def test_a_session_started_again_after_state_loss_replaces_the_stale_answer(isolated: Isolated) -> None:
    processor = SessionProcessor(SessionConfig())
    sink = RedisSignalSink(isolated.sinks())
    try:
        before = prompts_for(processor, processor.new_session("s1"), 0, 5)
        await sink.write([answer(p) for p in before])
        assert (await sink.read("s1"))["request_id"] == before[-1].request_id
        # The session state is lost (a redeploy without a savepoint, a state TTL): a blank session.
        after = prompts_for(processor, processor.new_session("s1"), len(before), 2)
        assert {p.request_id for p in after}.isdisjoint(p.request_id for p in before)
        await sink.write([answer(after[0])])
        stored = await sink.read("s1")
        assert stored["request_id"] == after[0].request_id
        assert (stored["session_epoch"], stored["seq"]) == (str(after[0].session_epoch), "1")
        assert stored["resets"] == "1" and sink.session_resets == 1
        # A late answer of the lost session never comes back over the new one; the next one goes on.
        await sink.write([answer(before[-1]), answer(after[1])])
        stored = await sink.read("s1")
        assert stored["request_id"] == after[1].request_id and stored["resets"] == "1"
        assert sink.stale_skipped == 1 and sink.session_resets == 1
    finally:
        await sink.close()


async def test_a_replay_from_the_same_first_event_reproduces_the_same_versions(isolated: Isolated) -> None:
    """Replaying a shopper's events from their first one rebuilds the same session: same epoch, same
    request ids, so every replayed answer is a duplicate to Redis, not a reset."""
    processor = SessionProcessor(SessionConfig())
    sink = RedisSignalSink(isolated.sinks())
    try:
        first = prompts_for(processor, processor.new_session("s1"), 0, 3)
        replayed = prompts_for(processor, processor.new_session("s1"), 0, 3)
        assert [p.request_id for p in replayed] == [p.request_id for p in first]
        await sink.write([answer(p) for p in first])
        await sink.write([answer(p) for p in replayed])
        assert sink.session_resets == 0 and sink.stale_skipped == len(replayed)
        assert "resets" in await sink.read("s1")
    finally:
        await sink.close()


def test_a_prompt_names_the_events_it_is_the_first_to_include() -> None:
    processor = SessionProcessor(SessionConfig())
    session = processor.new_session("s1")
    prompts = prompts_for(processor, session, 0, 3)
    assert [p.new_event_ids for p in prompts] == [["e0"], ["e1"], ["e2"]]
    restored = ShopperSession.from_json(session.to_json())
    assert restored.epoch == session.epoch == prompts[0].session_epoch
