"""Overload behaviour of the enrichment step (``pipeline.overload``) against a simulated replica over
HTTP: latest wins while waiting and in flight (the replica sees the abort and frees the slot, and the
newer prompt reuses the prefix the cancelled one computed, and its tokens count as not landed),
purchase and cart before browse pauses at a saturated gate, a standing queue served newest first,
prompts waiting past their class's budget dropped as stale, and one call for a prompt sent twice at
once.

The gate's only slot is held by the test itself where an order must be shown: nothing is admitted
until the test lets go, so the order does not depend on timing."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from bench.fleet import flat_samples
from llm_client import ClientConfig, LLMClient
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from pipeline.admission import Rank
from pipeline.admission_limit import AdaptiveLimitSettings
from pipeline.enrichment import Enricher, EnrichmentSettings
from pipeline.overload import OverloadPolicy, OverloadSettings
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import EnrichmentResult, PromptRequest, ShopperInsight, Superseded
from serving.simulator.testing import RunningSimulator, running_simulator
from tests.helpers import until
from tests.prompt_assembly.test_sessions import event

HELD: Rank = (-1, -1)
"""The rank of the slot the test holds by hand: before every prompt."""

WAIT_S = 30.0
"""Upper bound on waiting for a condition the test needs (never asserted: a hang guard)."""


def client_config(url: str, max_in_flight: int = 256) -> ClientConfig:
    return ClientConfig(
        endpoints=[url],
        max_in_flight=max_in_flight,
        timeouts=Timeouts(connect_s=2, attempt_s=20, deadline_s=30),
        health=HealthSettings(interval_s=0.05),
        retry=RetrySettings(backoff_base_s=0.01),
    )


def enricher(
    client: LLMClient, policy: OverloadPolicy = "latest_wins_priority", **overload: object
) -> Enricher:
    settings = OverloadSettings(policy=policy, **overload)
    return Enricher(client, EnrichmentSettings(overload=settings))


class Shopper:
    """A shopper's real prompts, each extending the previous one (``SessionProcessor``)."""

    def __init__(self, shopper_id: str) -> None:
        self.processor = SessionProcessor()
        self.session = self.processor.new_session(shopper_id)
        self.shopper_id = shopper_id
        self.ts = 1000.0

    def _apply(self, kind: str, after_s: float) -> PromptRequest:
        self.ts += after_s
        prompts = self.processor.apply(self.session, event(kind, self.ts, shopper=self.shopper_id)).prompts
        assert len(prompts) == 1, prompts
        return prompts[0]

    def cart(self) -> PromptRequest:
        """An add-to-cart prompt (past the per-shopper rate limit)."""
        self.processor.apply(self.session, event("view", self.ts + 11, shopper=self.shopper_id))
        prompt = self._apply("add_to_cart", 12)
        assert prompt.reason == "add_to_cart"
        return prompt

    def browse_pause(self) -> PromptRequest:
        """A browse-pause prompt: a view, then the next view after the quiet period."""
        self.processor.apply(self.session, event("view", self.ts + 61, shopper=self.shopper_id))
        prompt = self._apply("view", 120)
        assert prompt.reason == "browse_pause"
        return prompt


async def sim_metrics(sim: RunningSimulator) -> dict[str, float]:
    """The replica's /metrics over HTTP: sample name (with labels) -> value."""
    async with aiohttp.ClientSession() as http, http.get(f"{sim.url}/metrics") as response:
        return flat_samples(await response.text())


def requests_received(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("sim_requests_total"))


async def test_newer_prompt_supersedes_one_waiting_for_admission() -> None:
    shopper = Shopper("s-queued")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1)
        await enrich.gate.acquire(HELD)
        waiting = asyncio.create_task(enrich.enrich(older))
        await until(lambda: enrich.gate.waiting == 1)
        answered = asyncio.create_task(enrich.enrich(newer))
        superseded = await waiting  # returned while the gate's only slot is still held
        enrich.gate.release()
        result = await answered
        metrics = await sim_metrics(sim)
    assert isinstance(superseded, Superseded)
    assert superseded.cause == "newer_prompt" and superseded.superseded_by == newer.request_id
    assert not superseded.cancelled_in_flight
    assert isinstance(result, ShopperInsight) and result.request_id == newer.request_id
    assert result.admission_wait_ms > 0  # it waited for the slot the test held
    # each result says when its prompt became due: what freshness from due is measured from
    assert (superseded.due_ts, result.due_ts) == (older.due_ts, newer.due_ts) and older.due_ts < newer.due_ts
    assert requests_received(metrics) == 1  # the older prompt never reached the replica
    assert enrich.counts.superseded_queued == 1


async def test_in_flight_prompt_is_cancelled_and_the_newer_reuses_its_prefix() -> None:
    shopper = Shopper("s-in-flight")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=1.0) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client)
        first = asyncio.create_task(enrich.enrich(older))

        await until(lambda: sim.replica.engine.stats.decode_tokens > 0)  # prefilled: its blocks exist
        second = asyncio.create_task(enrich.enrich(newer))
        cancelled = await first

        async def aborted() -> bool:
            return (await sim_metrics(sim)).get("sim_request_errors_total{reason=aborted}", 0) == 1

        await until(aborted)  # at the replica's next disconnect poll
        result = await second
        metrics = await sim_metrics(sim)
    assert isinstance(cancelled, Superseded) and cancelled.cancelled_in_flight
    assert cancelled.superseded_by == newer.request_id
    assert isinstance(result, ShopperInsight)
    assert result.usage.cached_tokens > 0  # the cancelled prompt's blocks stayed in the cache
    assert metrics["sim_num_requests_running"] == 0  # the aborted request's slot was freed
    assert requests_received(metrics) == 2
    assert enrich.counts.cancelled_in_flight == 1
    # the cancelled prompt's tokens count as spent for nothing; the newer one's as landed
    assert enrich.tokens.not_landed_prefill == older.prompt_tokens - older.shared_prefix_tokens > 0
    assert enrich.tokens.landed_prefill == result.usage.prompt_tokens - result.usage.cached_tokens
    assert 0 < enrich.tokens.not_landed_share < 1


async def test_in_flight_prompt_finishes_when_cancelling_is_off() -> None:
    """With ``cancel_in_flight=False``, a newer prompt arriving while the older one is at the replica
    does not stop it: both are answered, and the replica sees no abort."""
    shopper = Shopper("s-let-finish")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=1.0) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, cancel_in_flight=False)
        first = asyncio.create_task(enrich.enrich(older))
        await until(lambda: sim.replica.engine.stats.decode_tokens > 0)  # at the replica: in flight
        assert requests_received(await sim_metrics(sim)) == 1 and not first.done()
        second = asyncio.create_task(enrich.enrich(newer))

        async def newer_sent() -> bool:
            return requests_received(await sim_metrics(sim)) == 2

        await until(newer_sent)  # the newer prompt reached the replica ...
        overlapped = not first.done()  # ... while the older one was still being answered
        results = [await first, await second]
        metrics = await sim_metrics(sim)
    assert [type(r) for r in results] == [ShopperInsight, ShopperInsight], results
    assert overlapped
    assert [r.request_id for r in results] == [older.request_id, newer.request_id]
    assert enrich.counts.cancelled_in_flight == 0
    assert metrics.get("sim_request_errors_total{reason=aborted}", 0) == 0


async def admission_order(
    policy: OverloadPolicy, *, gate_slots: int = 1, client_slots: int = 256
) -> list[str]:
    """Two browse pauses, then two cart adds, of four shoppers, queued at a gate of one slot (the least
    of ``gate_slots`` and the client's ``client_slots``) that the test holds; the order in which they are
    answered once it lets go."""
    browse = [Shopper(f"s-browse-{i}").browse_pause() for i in range(2)]
    cart = [Shopper(f"s-cart-{i}").cart() for i in range(2)]
    answered: list[str] = []
    async with (
        running_simulator(time_scale=0.01) as sim,
        LLMClient(client_config(sim.url, max_in_flight=client_slots)) as client,
    ):
        enrich = enricher(client, policy, max_in_flight=gate_slots, freshness_target_s=WAIT_S)

        async def one(prompt: PromptRequest) -> EnrichmentResult:
            result = await enrich.enrich(prompt)
            answered.append(prompt.shopper_id)
            return result

        await enrich.gate.acquire(HELD)
        tasks = []
        for prompt in browse + cart:
            tasks.append(asyncio.create_task(one(prompt)))
            queued = len(tasks)
            await until(lambda: enrich.gate.waiting == queued)  # noqa: B023 - awaited in this iteration
        enrich.gate.release()
        results = await asyncio.gather(*tasks)
    assert all(isinstance(r, ShopperInsight) for r in results)
    return answered


async def test_purchase_and_cart_go_before_browse_pauses_at_a_saturated_gate() -> None:
    assert await admission_order("latest_wins_priority") == [
        "s-cart-0",
        "s-cart-1",
        "s-browse-0",
        "s-browse-1",
    ]
    assert await admission_order("latest_wins") == ["s-browse-0", "s-browse-1", "s-cart-0", "s-cart-1"]


async def test_the_gate_admits_no_more_than_the_client_has_slots_for() -> None:
    """A gate of four slots over a client of one: the three it admitted past the client's slot waited
    at the client in arrival order, where purchase and cart no longer go first (and where no freshness
    budget applies). The gate holds to the client's slots, so they wait at the gate, by priority."""
    assert await admission_order("latest_wins_priority", gate_slots=4, client_slots=1) == [
        "s-cart-0",
        "s-cart-1",
        "s-browse-0",
        "s-browse-1",
    ]


async def test_with_a_backfill_a_prompt_past_its_budget_goes_behind_fresher_ones_and_is_answered() -> None:
    """With a backfill (``max_backfill``), a browse pause that waited past the freshness target is not
    dropped: it is its shopper's newest prompt, and dropped it would leave the shopper's signal old until
    a next trigger. It goes behind the cart add that arrives after it and is answered once there is room."""
    browse, cart = Shopper("s-late").browse_pause(), Shopper("s-buyer").cart()
    answered: list[str] = []
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1, freshness_target_s=0.05, max_backfill=256)

        async def one(prompt: PromptRequest) -> EnrichmentResult:
            result = await enrich.enrich(prompt)
            answered.append(prompt.shopper_id)
            return result

        await enrich.gate.acquire(HELD)
        late = asyncio.create_task(one(browse))
        await until(lambda: enrich.gate.backfilled == 1)  # past its budget, still waiting
        fresh = asyncio.create_task(one(cart))
        await until(lambda: enrich.gate.waiting == 2)
        enrich.gate.release()
        results = [await late, await fresh]
        metrics = await sim_metrics(sim)
    assert [type(r) for r in results] == [ShopperInsight, ShopperInsight]
    assert answered == ["s-buyer", "s-late"]
    assert requests_received(metrics) == 2
    assert enrich.counts.dropped_stale == 0


async def test_a_full_backfill_lets_its_longest_waiting_prompt_go_as_stale() -> None:
    """The backfill is bounded (``max_backfill``): a prompt that finds it full makes room by dropping
    the one that has waited longest, as stale; the newer one is answered."""
    first, second = Shopper("s-old").browse_pause(), Shopper("s-new").browse_pause()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1, freshness_target_s=0.05, max_backfill=1)
        await enrich.gate.acquire(HELD)
        dropping = asyncio.create_task(enrich.enrich(first))
        await until(lambda: enrich.gate.backfilled == 1)
        kept = asyncio.create_task(enrich.enrich(second))
        dropped = await dropping  # returns while the slot is still held
        assert enrich.gate.waiting == 1
        enrich.gate.release()
        answered = await kept
        metrics = await sim_metrics(sim)
    assert isinstance(dropped, Superseded) and dropped.cause == "stale" and dropped.superseded_by is None
    assert isinstance(answered, ShopperInsight)
    assert requests_received(metrics) == 1
    assert (enrich.counts.dropped_stale, enrich.gate.backfilled) == (1, 2)


async def test_by_default_a_browse_pause_waiting_past_the_freshness_target_is_dropped() -> None:
    browse, cart = Shopper("s-stale").browse_pause(), Shopper("s-buyer").cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1, freshness_target_s=0.05)
        await enrich.gate.acquire(HELD)
        waiting_cart = asyncio.create_task(enrich.enrich(cart))
        dropped = await enrich.enrich(browse)  # returns while the slot is still held
        assert enrich.gate.waiting == 1  # the cart add still waits: within its budget
        enrich.gate.release()
        answered = await waiting_cart
        metrics = await sim_metrics(sim)
    assert isinstance(dropped, Superseded) and dropped.cause == "stale" and dropped.superseded_by is None
    assert isinstance(answered, ShopperInsight)
    assert requests_received(metrics) == 1
    assert enrich.counts.dropped_stale == 1


async def test_by_default_a_cart_add_waiting_past_its_budget_is_dropped() -> None:
    """Purchase and cart go first, but their wait is bounded too (``urgent_max_wait_s``): when they
    alone are more than the fleet answers, the oldest leave the queue rather than wait ever longer."""
    cart = Shopper("s-cart-stale").cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1, urgent_max_wait_s=0.05)
        await enrich.gate.acquire(HELD)
        async with asyncio.timeout(WAIT_S):
            dropped = await enrich.enrich(cart)  # returns while the slot is still held
        enrich.gate.release()
        metrics = await sim_metrics(sim)
    assert isinstance(dropped, Superseded) and dropped.cause == "stale" and dropped.superseded_by is None
    assert requests_received(metrics) == 0
    assert enrich.counts.dropped_stale == 1


async def test_a_standing_queue_is_served_newest_first() -> None:
    """Three cart adds of three shoppers queue behind the slot the test holds, past ``lifo_after_s``:
    the newest goes first, then (the queue still standing) the next newest; by default without a
    standing queue (``test_purchase_and_cart_go_before_browse_pauses_at_a_saturated_gate``) the oldest."""
    carts = [Shopper(f"s-lifo-{i}").cart() for i in range(3)]
    answered: list[str] = []
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1, lifo_after_s=0.01, urgent_max_wait_s=WAIT_S)

        async def one(prompt: PromptRequest) -> EnrichmentResult:
            result = await enrich.enrich(prompt)
            answered.append(prompt.shopper_id)
            return result

        await enrich.gate.acquire(HELD)
        tasks = []
        for prompt in carts:
            tasks.append(asyncio.create_task(one(prompt)))
            queued = len(tasks)
            await until(lambda: enrich.gate.waiting == queued)  # noqa: B023 - awaited in this iteration
        await until(lambda: enrich.gate.oldest_wait_s(0) > 0.01)  # the queue stands
        enrich.gate.release()
        results = await asyncio.gather(*tasks)
    assert all(isinstance(r, ShopperInsight) for r in results)
    assert answered == ["s-lifo-2", "s-lifo-1", "s-lifo-0"]
    assert enrich.gate.admitted_newest_first == 2  # the last one left was the oldest and the newest


async def test_the_same_prompt_twice_at_once_is_sent_once() -> None:
    prompt = Shopper("s-twice").cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client)
        results = await asyncio.gather(enrich.enrich(prompt), enrich.enrich(prompt))
        metrics = await sim_metrics(sim)
    assert [type(r) for r in results] == [ShopperInsight, ShopperInsight]
    assert results[1] == results[0].model_copy(update={"replayed": True})  # asked the model nothing
    assert requests_received(metrics) == 1
    assert enrich.counts.joined == 1


async def test_an_older_prompt_arriving_after_a_newer_one_is_superseded_at_once() -> None:
    shopper = Shopper("s-late")
    older, newer = shopper.cart(), shopper.cart()
    async with running_simulator(time_scale=0.2) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client)
        answering = asyncio.create_task(enrich.enrich(newer))
        await until(lambda: enrich.gate.active == 1)
        late = await enrich.enrich(older)
        await answering
        metrics = await sim_metrics(sim)
    assert isinstance(late, Superseded) and late.superseded_by == newer.request_id
    assert requests_received(metrics) == 1


async def test_a_replay_joined_to_a_call_whose_caller_went_away_is_still_answered() -> None:
    """A replayed prompt joins the same prompt's call. When that call's own caller is cancelled (a
    shutdown, its timeout), the call ends with no newer prompt: the joiner was recorded as superseded
    by a newer prompt that did not exist, and the shopper's newest prompt was never answered. It is
    asked again now."""
    prompt = Shopper("s-replay").cart()
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        enrich = enricher(client, max_in_flight=1)
        await enrich.gate.acquire(HELD)
        first = asyncio.create_task(enrich.enrich(prompt))
        await until(lambda: enrich.gate.waiting == 1)
        replay = asyncio.create_task(enrich.enrich(prompt))
        await until(lambda: enrich.counts.joined == 1)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        enrich.gate.release()
        result = await replay
        assert isinstance(result, ShopperInsight) and not result.replayed, result
        assert enrich.counts.joined == 0


async def test_answers_not_streamed_do_not_cut_the_admission_limit() -> None:
    """Unstreamed, an answer's time to first token is its whole latency: every ordinary answer longer
    than ``adaptive.queue_ttft_ms`` (a 200-token decode) read as a queue at the replica and cut the
    limit, down to one prompt a replica on a healthy fleet. The limit learns only from streamed
    answers."""
    adaptive = AdaptiveLimitSettings(queue_ttft_ms=300.0, cut_interval_s=0.001)
    async with running_simulator(time_scale=1.0) as sim:
        config = client_config(sim.url).model_copy(update={"stream": False})
        async with LLMClient(config) as client:
            enrich = enricher(client, adaptive=adaptive, freshness_target_s=WAIT_S)
            results = await asyncio.gather(*(enrich.enrich(Shopper(f"s{i}").cart()) for i in range(3)))
            assert all(isinstance(r, ShopperInsight) and r.ttft_ms > 300 for r in results)
            assert (enrich.gate.limit, enrich.fleet_limit.cuts) == (16, 0)


async def test_the_limit_does_not_grow_past_the_clients_slots() -> None:
    """Prompts wait at the gate because the client has four slots, not because of the adaptive limit
    (16 for one replica). Every fast answer with prompts waiting raised the limit all the same, up to
    64 a replica, so when the replica then queued, each cut (x0.75, one per ``cut_interval_s``) began
    far above what was admitted, and the first that took effect came seconds late."""
    async with (
        running_simulator(time_scale=0.01) as sim,
        LLMClient(client_config(sim.url, max_in_flight=4)) as client,
    ):
        enrich = enricher(client, freshness_target_s=WAIT_S, urgent_max_wait_s=WAIT_S)
        start = enrich.fleet_limit()
        prompts = [Shopper(f"s-slots-{i}").cart() for i in range(40)]
        results = await asyncio.gather(*(enrich.enrich(prompt) for prompt in prompts))
        assert all(isinstance(r, ShopperInsight) for r in results)
        assert enrich.gate.limit == 4
        assert enrich.fleet_limit() == start == 16, "the limit grew while the client's slots held"


async def test_a_prompt_still_waiting_to_be_sent_is_displaced_as_queued() -> None:
    """Admitted by the gate, a prompt can still wait for the client's slot (held here by another
    caller), a routable replica or a retry's backoff. It was marked in flight at admission: displaced
    there, it counted as cancelled in flight, its tokens as spent for nothing, and with
    ``cancel_in_flight`` off it was let finish and sent, stale. It is in flight once an attempt starts."""
    async with running_simulator(time_scale=0.01) as sim, LLMClient(client_config(sim.url)) as client:
        for cancel_in_flight in (True, False):
            enrich = enricher(client, cancel_in_flight=cancel_in_flight, freshness_target_s=WAIT_S)
            shopper = Shopper(f"s-waiting-{cancel_in_flight}")
            older, newer = shopper.cart(), shopper.cart()
            slots = [client._calls._gate.acquire() for _ in range(client.config.max_in_flight)]
            await asyncio.gather(*slots)  # every client slot busy: nothing is sent
            first = asyncio.create_task(enrich.enrich(older))
            await until(lambda: enrich.gate.active == 1)  # noqa: B023 - awaited in this iteration
            second = asyncio.create_task(enrich.enrich(newer))
            await until(lambda: enrich.counts.superseded_queued + enrich.counts.cancelled_in_flight > 0)  # noqa: B023
            for _ in range(client.config.max_in_flight):
                client._calls._gate.release()
            displaced, answered = await first, await second
            assert isinstance(displaced, Superseded) and not displaced.cancelled_in_flight
            assert isinstance(answered, ShopperInsight)
            assert enrich.counts.cancelled_in_flight == 0 and enrich.tokens.not_landed_prefill == 0
