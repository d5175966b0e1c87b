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


async def test_an_answer_back_in_the_turn_a_newer_prompt_comes_is_kept() -> None:
    """The older prompt's answer is in the client (its stream's last bytes read in this loop turn);
    the shopper's next prompt is handed over in the same turn, ahead of the client's last step. The
    displacement cancelled the older prompt's task before that step ran: a paid-for answer became
    ``Superseded(cancelled_in_flight)``, and the replica's work on it was lost."""
    shopper = Shopper("s-answer-back")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        chat = client.chat
        last_bytes: list[asyncio.Future[None]] = []

        async def held_at_its_last_step(*args: Any, **kwargs: Any) -> Completion:
            completion = await chat(*args, **kwargs)
            last_bytes.append(asyncio.get_running_loop().create_future())
            await last_bytes[-1]
            return completion

        client.chat = held_at_its_last_step  # type: ignore[method-assign]
        enrich = enricher(client)
        first = asyncio.create_task(enrich.enrich(older))
        await until(lambda: len(last_bytes) == 1)  # answered by the replica, in the client
        second = asyncio.create_task(enrich.enrich(newer))  # the next poll's prompt ...
        last_bytes[0].set_result(None)  # ... and the older answer's last step, in the same turn
        kept = await first
        await until(lambda: len(last_bytes) == 2)
        last_bytes[1].set_result(None)
        answered = await second
        metrics = await sim_metrics(sim)
    assert isinstance(kept, ShopperInsight) and kept.request_id == older.request_id, kept
    assert isinstance(answered, ShopperInsight) and answered.request_id == newer.request_id
    assert requests_received(metrics) == 2
    assert enrich.counts.cancelled_in_flight == 0 and enrich.tokens.not_landed_prefill == 0


async def test_an_answer_whose_bytes_come_after_the_displacement_in_its_turn_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other order within one loop turn: the newer prompt's step (queued by the turn before) runs
    first and displaces the older one, then the turn's reads hand the older call its last bytes. The
    call's last step is queued behind whatever the displacement queued: a cut one pass later found the
    call not done and cancelled it with its answer in; the cut now waits two passes
    (``latest_wins.cut_soon``)."""
    shopper = Shopper("s-bytes-after-displace")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        chat = client.chat
        last_bytes: list[asyncio.Future[None]] = []

        async def held_at_its_last_step(*args: Any, **kwargs: Any) -> Completion:
            completion = await chat(*args, **kwargs)
            last_bytes.append(asyncio.get_running_loop().create_future())
            await last_bytes[-1]
            return completion

        displace = Claim.displace

        def displace_then_the_bytes_come(
            claim: Claim, newer: PromptRequest, *, cancel_in_flight: bool
        ) -> bool:
            cut = displace(claim, newer, cancel_in_flight=cancel_in_flight)
            last_bytes[0].set_result(None)  # the read of this turn, after the displacing step
            return cut

        client.chat = held_at_its_last_step  # type: ignore[method-assign]
        enrich = enricher(client)
        first = asyncio.create_task(enrich.enrich(older))
        await until(lambda: len(last_bytes) == 1)  # answered by the replica, in the client
        monkeypatch.setattr(Claim, "displace", displace_then_the_bytes_come)
        second = asyncio.create_task(enrich.enrich(newer))
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
