"""Latest wins as a pure rule (``pipeline.latest_wins.ShopperClaims``): whatever order a shopper's
prompts arrive in, the newest version seen holds the claim, and every arrival is told whether it is
the newest, the one already held, or older."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipeline.latest_wins import Arrival, ShopperClaims
from prompt_assembly.records import PromptRequest, request_id

versions = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.integers(1, 5))


def prompt(shopper: str, epoch: int, seq: int) -> PromptRequest:
    return PromptRequest(
        request_id=request_id(shopper, epoch, seq),
        shopper_id=shopper,
        session_epoch=epoch,
        seq=seq,
        reason="browse_pause",
        messages=[],
        event_count=1,
        last_event_ts=0.0,
        prompt_tokens=1,
        shared_prefix_tokens=0,
    )


@given(st.lists(versions, max_size=40))
def test_the_newest_version_holds_each_shopper(arrivals: list[tuple[str, int, int]]) -> None:
    claims = ShopperClaims()
    newest: dict[str, tuple[int, int]] = {}
    for shopper, epoch, seq in arrivals:
        arrival, displaced, held = claims.arrive(prompt(shopper, epoch, seq))
        before = newest.get(shopper)
        if before is None or (epoch, seq) > before:
            assert arrival is Arrival.NEWEST and held.version == (epoch, seq)
            assert (displaced is None) == (before is None)
            newest[shopper] = (epoch, seq)
        elif (epoch, seq) == before:
            assert arrival is Arrival.SAME and displaced is None
        else:
            assert arrival is Arrival.OLDER and held.version == before
    assert len(claims) == len(newest)


def test_a_claim_left_is_forgotten_unless_a_newer_one_holds() -> None:
    claims = ShopperClaims()
    _, _, first = claims.arrive(prompt("a", 0, 1))
    _, _, second = claims.arrive(prompt("a", 0, 2))
    claims.leave(first)  # displaced: the newer claim stays
    assert claims.arrive(prompt("a", 0, 2))[0] is Arrival.SAME
    claims.leave(second)
    assert len(claims) == 0


async def test_a_claim_whose_work_already_ended_is_not_counted_as_displaced() -> None:
    """A prompt dropped as stale ends its work (its task returns) a loop turn before its owner leaves
    the claim; a newer prompt arriving in between displaced it all the same, and the enricher counted
    one prompt both as dropped stale and as superseded while queued."""

    async def dropped_as_stale() -> Any:
        return None

    claims = ShopperClaims()
    _, _, older = claims.arrive(prompt("a", 1, 1))
    older.task = asyncio.create_task(dropped_as_stale())
    await older.task
    arrival, displaced, _ = claims.arrive(prompt("a", 1, 2))
    assert arrival is Arrival.NEWEST and displaced is older
    assert not older.displace(prompt("a", 1, 2), cancel_in_flight=True)
    assert not older.task.cancelled()


def test_the_same_request_id_for_more_events_is_the_newer_prompt_not_a_join() -> None:
    """A restored Flink job's timer waits for the replay, so it can send seq n again under the same
    ``request_id`` with an event more. Joined to the first copy still waiting, it got that copy's
    answer, and the event it added was named by no result; it takes the claim over instead."""
    first = prompt("a", 1, 1).model_copy(update={"new_event_ids": ["e1"]})
    again = first.model_copy(update={"new_event_ids": ["e1", "e2"]})
    claims = ShopperClaims()
    _, _, held = claims.arrive(first)
    assert claims.arrive(first.model_copy())[0] is Arrival.SAME
    arrival, displaced, now_held = claims.arrive(again)
    assert arrival is Arrival.NEWEST and displaced is held and now_held.prompt is again


def test_the_same_request_id_that_trimmed_other_events_is_the_newer_prompt_not_a_join() -> None:
    """The same ``request_id`` and new events, but another trim (a replay whose session was trimmed
    at another point) names other events in its result: it is a prompt of its own, not a join."""
    first = prompt("a", 1, 1).model_copy(update={"new_event_ids": ["e3"], "trimmed_event_ids": ["e1"]})
    again = first.model_copy(update={"trimmed_event_ids": ["e1", "e2"]})
    claims = ShopperClaims()
    _, _, held = claims.arrive(first)
    arrival, displaced, now_held = claims.arrive(again)
    assert arrival is Arrival.NEWEST and displaced is held and now_held.prompt is again
