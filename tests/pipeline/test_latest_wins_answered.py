"""Latest wins keeps an answer that already came back (docs/overload.md): a shopper's newer prompt that
arrives in the loop turn in which the older prompt's answer arrived does not throw that answer away.
A simulated replica over HTTP answers; the client's last step is held until the test lets it run, so
that both arrive in one loop turn."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llm_client import LLMClient
from llm_client.models import Completion
from pipeline.latest_wins import Claim
from prompt_assembly.records import PromptRequest, ShopperInsight
from serving.simulator.testing import running_simulator
from tests.helpers import until
from tests.pipeline.test_overload import Shopper, client_config, enricher, requests_received, sim_metrics


def held_at_their_last_step(client: LLMClient) -> list[asyncio.Future[None]]:
    """Hold each call of ``client`` at its last step, its answer in hand, until the test resolves the
    future the call appended."""
    chat = client.chat
    last_bytes: list[asyncio.Future[None]] = []

    async def held_at_its_last_step(*args: Any, **kwargs: Any) -> Completion:
        completion = await chat(*args, **kwargs)
        last_bytes.append(asyncio.get_running_loop().create_future())
        await last_bytes[-1]
        return completion

    client.chat = held_at_its_last_step  # type: ignore[method-assign]
    return last_bytes


@pytest.mark.parametrize("displaced_first", [False, True], ids=["bytes_then_newer", "newer_then_bytes"])
async def test_an_answer_back_in_the_turn_a_newer_prompt_comes_is_kept(
    displaced_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The older prompt's answer is in the client (its last bytes read in this loop turn), and the
    shopper's next prompt is handed over in the same turn. Either order within the turn:
    - the bytes' step queued first: the displacement cancelled the older prompt's task before that
      step ran, and a paid-for answer became ``Superseded(cancelled_in_flight)`` (until 6 Dec 2026);
    - the newer prompt's step (queued by the turn before) runs first and displaces the older one, then
      the turn's reads queue the call's last step behind what the displacement queued: a cut one pass
      later found the call not done and cancelled it (until 7 Dec 2026; the cut now waits two passes,
      ``latest_wins.cut_soon``)."""
    shopper = Shopper(f"s-answer-back-{displaced_first}")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        last_bytes = held_at_their_last_step(client)
        displace = Claim.displace

        def displace_then_the_bytes_come(
            claim: Claim, newer: PromptRequest, *, cancel_in_flight: bool
        ) -> bool:
            cut = displace(claim, newer, cancel_in_flight=cancel_in_flight)
            last_bytes[0].set_result(None)  # the read of this turn, after the displacing step
            return cut

        enrich = enricher(client)
        first = asyncio.create_task(enrich.enrich(older))
        await until(lambda: len(last_bytes) == 1)  # answered by the replica, in the client
        if displaced_first:
            monkeypatch.setattr(Claim, "displace", displace_then_the_bytes_come)
        second = asyncio.create_task(enrich.enrich(newer))  # the next poll's prompt ...
        if not displaced_first:
            last_bytes[0].set_result(None)  # ... and the older answer's last step, in the same turn
        kept = await first
        monkeypatch.undo()
        await until(lambda: len(last_bytes) == 2)
        last_bytes[1].set_result(None)
        answered = await second
        metrics = await sim_metrics(sim)
    assert isinstance(kept, ShopperInsight) and kept.request_id == older.request_id, kept
    assert isinstance(answered, ShopperInsight) and answered.request_id == newer.request_id
    assert requests_received(metrics) == 2
    assert enrich.counts.cancelled_in_flight == 0 and enrich.tokens.not_landed_prefill == 0
