"""Routing by predicted time to first token: the prediction on hand-built queues, the spill-over and its
hysteresis, live group weights, learned speeds and KV affinity across a spill (pure), then the same
against simulator processes in two "regions"."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from llm_client import ClientConfig, LLMClient
from llm_client.endpoints import Endpoint
from llm_client.routing import make_policy
from llm_client.routing.base import RouteOutcome, RouteRequest
from llm_client.routing.predicted_ttft import EndpointGroup, PredictedTtftPolicy, PredictedTtftSettings
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from prompt_assembly.errors import ConfigurationError
from prompt_assembly.tokens import count_tokens
from serving.simulator.launch import SimulatorFleet
from tests.helpers import viewed_prompt


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def route(text: str, key: str = "s1") -> RouteRequest:
    return RouteRequest(key, text, count_tokens(text), 200)


def words(n: int, seed: str = "w") -> str:
    """About ``1.5 x n`` tokens: three a word (" w", "4", "x"; the tokenizer takes one digit a token), so
    a seed's digits are spelled as letters."""
    seed = seed.translate(str.maketrans("0123456789", "abcdefghij"))
    return "".join(f" {seed}{i % 10}x" for i in range(n // 2))


def fleet() -> tuple[list[Endpoint], list[Endpoint]]:
    local = [Endpoint(f"http://local{i}", f"local{i}") for i in range(2)]
    remote = [Endpoint(f"http://east{i}", f"east{i}") for i in range(2)]
    return local, remote


def policy(clock: Clock, **knobs: object) -> PredictedTtftPolicy:
    local, remote = fleet()
    groups = [
        EndpointGroup(name="local", endpoints=[e.url for e in local], ms_per_token=0.1),
        EndpointGroup(name="east", endpoints=[e.url for e in remote], rtt_ms=60, ms_per_token=0.2),
    ]
    settings = PredictedTtftSettings(
        groups=groups,
        slo_ms=1000,
        spill_ratio=1.0,
        return_ratio=0.7,
        min_spill_s=10,
        first_token_floor_ms=0,
    )
    return PredictedTtftPolicy(settings, clock=clock, **knobs)


def test_the_prediction_is_rtt_plus_speed_times_queued_and_uncached_work() -> None:
    p = policy(Clock())
    local, remote = fleet()
    local[0].outstanding_prefill_tokens = 3000
    local[1].outstanding_prefill_tokens, local[1].outstanding_decode_tokens = 500, 1000
    request = route(words(2000))
    n = request.prompt_tokens
    decode_weight = p.settings.prefix.decode_weight
    assert p.predicted_ttft_ms(request, local[0]) == pytest.approx(0.1 * (3000 + n))
    assert p.predicted_ttft_ms(request, local[1]) == pytest.approx(0.1 * (500 + decode_weight * 1000 + n))
    assert p.predicted_ttft_ms(request, remote[0]) == pytest.approx(60 + 0.2 * n)
    # A fast replica with a queue against a slow one without: the smaller predicted time wins.
    fast, slow = Endpoint("http://local0", "local0"), Endpoint("http://local1", "local1")
    p2 = PredictedTtftPolicy(
        PredictedTtftSettings(
            groups=[
                EndpointGroup(name="local", endpoints=["http://local0"], ms_per_token=0.1),
                EndpointGroup(name="other", endpoints=["http://local1"], ms_per_token=0.4),
            ],
            local_group="local",
            slo_ms=10_000,
        )
    )
    fast.outstanding_prefill_tokens = 2 * n  # 0.1 x 3n < 0.4 x n? no: 0.3n < 0.4n, so fast wins
    assert p2.choose(route(words(2000)), [fast, slow]) is fast
    fast.outstanding_prefill_tokens = 4 * n  # 0.5n > 0.4n: still local, the SLO holds locally
    assert p2.choose(route(words(2000), key="s2"), [fast, slow]) is fast


def test_spill_over_waits_for_the_slo_and_comes_back_only_past_the_hysteresis() -> None:
    clock = Clock()
    p = policy(clock, typical_prefill_alpha=1.0)  # every prompt of one size: the typical one is the last
    local, remote = fleet()
    endpoints = [*local, *remote]
    request_tokens = route(words(2000)).prompt_tokens

    def set_local_ms(ms: float) -> None:  # local prediction = 0.1 ms/token x (queue + prompt)
        for e in local:
            e.outstanding_prefill_tokens = int(ms / 0.1) - request_tokens

    chosen_groups = []
    # The local prediction wanders around the SLO: 900, 1100, 950, 1050, 800, 650 ms, 2 s apart.
    for i, ms in enumerate([900, 1100, 950, 1050, 800, 650]):
        set_local_ms(ms)
        chosen = p.choose(route(words(2000, f"k{i}"), key=f"k{i}"), endpoints)  # nothing cached yet
        chosen_groups.append(p.group(chosen))
        clock.now += 2
    # East predicts 60 ms + 0.2 ms x 3,000 tokens = 660 ms. These shoppers are cold everywhere, so
    # while spilled each goes where it is answered soonest: east until local predicts under 660 ms.
    assert chosen_groups == ["local", "east", "east", "east", "east", "local"]
    assert p.stats.spills == 1 and p.stats.returns == 0, "no flapping around the SLO"
    assert p.stats.spilled_requests == 5 and p.stats.kept_local_while_spilled == 0
    assert p.spilling  # under return_ratio x SLO, but before min_spill_s since the spill began
    set_local_ms(1100)
    assert p.group(p.choose(route(words(2000, "again"), key="again"), endpoints)) == "east"
    assert p.stats.spills == 1, "a rebound while spilled is no new spill"
    clock.now += 10
    set_local_ms(650)
    assert p.group(p.choose(route(words(2000, "back"), key="back"), endpoints)) == "local"
    assert p.stats.returns == 1 and not p.spilling


def default_policy(clock: Clock) -> tuple[PredictedTtftPolicy, list[Endpoint], list[Endpoint]]:
    """The default settings (SLO 1 s, spill past 0.8 of it, return under 0.6, a 100 ms floor and
    0.122 ms a token) over two local replicas and two 40 ms away."""
    local, remote = fleet()
    settings = PredictedTtftSettings(
        groups=[EndpointGroup(name="east", endpoints=[e.url for e in remote], rtt_ms=40)]
    )
    return PredictedTtftPolicy(settings, clock=clock), local, remote


def test_one_long_cold_prompt_on_an_idle_fleet_is_no_reason_to_spill() -> None:
    """The spill state is the local load, for a typical request: decided on each request's own
    prediction, one cold 6,000-token prompt on an idle fleet (100 + 0.122 x 6,000 = 832 ms, over 800)
    spilled every request for min_spill_s, so the state followed the mix of prompt sizes, not load."""
    p, local, remote = default_policy(Clock())
    long = route(words(4000, "long"), key="long")
    assert long.prompt_tokens == 6000
    assert p.predicted_ttft_ms(long, local[0]) > p.settings.spill_ratio * p.settings.slo_ms
    assert p.group(p.choose(long, [*local, *remote])) == "local"
    assert not p.spilling and p.stats.spills == 0


def test_queued_local_replicas_spill_and_drained_ones_bring_it_back_whatever_the_request() -> None:
    """Coming back is decided for a typical request too: on each request's own prediction it took one
    predicted under 600 ms, and long cold prompts kept an idle local group spilled."""
    clock = Clock()
    p, local, remote = default_policy(clock)
    endpoints = [*local, *remote]
    for e in local:  # 7,000 queued tokens each: a 954 ms wait before any prefill starts
        e.outstanding_prefill_tokens = 7000
    p.choose(route(words(200, "short"), key="short"), endpoints)  # a 300-token prompt
    assert p.spilling and p.stats.spills == 1
    for e in local:
        e.outstanding_prefill_tokens = 0
    clock.now += p.settings.min_spill_s
    assert p.group(p.choose(route(words(4000, "long"), key="long"), endpoints)) == "local"
    assert not p.spilling and p.stats.returns == 1


def test_a_short_prompt_spills_where_a_typical_request_would_miss_behind_the_queue() -> None:
    """The typical request's own prefill counts (the state is not the queue alone, which would keep
    cold prompts home until the wait by itself passed the threshold), and this request's does not."""
    p, local, remote = default_policy(Clock())
    endpoints = [*local, *remote]
    for i in range(60):  # cold 3,000-token prompts on an idle fleet: 466 ms each, no spill
        p.choose(route(words(2000, f"c{i}"), key=f"c{i}"), endpoints)
    assert not p.spilling
    for e in local:  # 3,500 queued tokens each: a 527 ms wait, and a typical request 100 + 0.122 x ~6,200
        e.outstanding_prefill_tokens = 3500
    short = route(words(200, "short"), key="short")  # this one would take 100 + 0.122 x 3,800 = 564 ms
    assert p.predicted_ttft_ms(short, local[0]) < p.settings.return_ratio * p.settings.slo_ms
    p.choose(short, endpoints)
    assert p.spilling and p.stats.spills == 1
    assert p.typical_uncached_tokens == pytest.approx(3000 * (1 - 0.95**60) * 0.95 + 0.05 * 300, rel=0.02)


def test_while_spilled_a_shopper_warm_at_home_stays_and_a_cold_one_spills() -> None:
    clock = Clock()
    p = policy(clock, typical_prefill_alpha=1.0)  # the typical request is the last one
    local, remote = fleet()
    endpoints = [*local, *remote]
    history = words(3000, "h")
    warm = route(history, key="warm")
    assert p.choose(warm, endpoints) in local  # calm: warm's prefix is now held at home
    home = next(e for e in local if p.prefix.cached_tokens(warm, e) > 0)
    for e in local:  # a surge: 7,000 queued tokens ahead on each local replica (700 ms)
        e.outstanding_prefill_tokens = 7000
    cold = route(words(3000, "c"), key="cold")  # 700 + 0.1 x ~4,500 > 1,000 ms at home: it spills
    assert p.group(p.choose(cold, endpoints)) == "east" and p.spilling
    again = route(history + words(100, "n"), key="warm")  # 700 + 0.1 x (a few new blocks) < 1,000 ms
    assert p.choose(again, endpoints) is home, "its warm prefix keeps it home: no cold prefill east"
    assert p.stats.spilled_requests == 1 and p.stats.kept_local_while_spilled == 1


def test_prefix_aware_costs_become_time_so_a_slow_replica_needs_half_the_queue() -> None:
    fast, slow = Endpoint("http://f", "fast"), Endpoint("http://s", "slow")
    p = PredictedTtftPolicy(
        PredictedTtftSettings(
            groups=[EndpointGroup(name="local", endpoints=["http://f", "http://s"], ms_per_token=0.1)],
            slo_ms=100_000,
            speed_alpha=1.0,
            first_token_floor_ms=0,
        ),
        clock=Clock(),  # the real clock let the learned speed decay between two lines on a loaded machine
    )
    probe = route(words(2000, "probe"), key="probe")
    assert p.choose(probe, [slow]) is slow
    p.observe(
        probe,
        slow,
        RouteOutcome(
            ok=True, prompt_tokens=probe.prompt_tokens, ttft_ms=0.2 * probe.prompt_tokens, first_token=True
        ),
    )
    assert p.ms_per_token(slow) == pytest.approx(0.2)  # learned: a second accelerator kind, half the speed
    n = probe.prompt_tokens
    fast.outstanding_prefill_tokens = n // 2
    # In tokens the idle slow replica is cheaper, and prefix_aware alone would pick it; in time the fast
    # one answers first (0.1 x 1.5n < 0.2 x n).
    assert p.prefix.choose(route(words(2000, "a"), key="a"), [fast, slow]) is slow
    assert p.choose(route(words(2000, "b"), key="b"), [fast, slow]) is fast
    fast.outstanding_prefill_tokens = 2 * n  # 0.1 x 3n > 0.2 x n: now the slow one is sooner
    assert p.choose(route(words(2000, "c"), key="c"), [fast, slow]) is slow


def test_group_weights_change_live_and_zero_takes_a_group_out() -> None:
    clock = Clock()
    p = policy(clock)
    local, remote = fleet()
    for e in local:
        e.outstanding_prefill_tokens = 50_000  # local far over the SLO: spilled
    remote[1].outstanding_prefill_tokens = 100
    assert p.choose(route(words(2000), key="a"), [*local, *remote]) is remote[0]
    p.set_group_weight("east", 0.0)
    assert p.group(p.choose(route(words(2000), key="b"), [*local, *remote])) == "local"
    assert p.group_weights() == {"local": 1.0, "east": 0.0}
    with pytest.raises(ConfigurationError):
        p.set_group_weight("west", 1.0)
    with pytest.raises(ConfigurationError):
        p.set_group_weight("east", -1.0)


def test_a_slow_replica_is_learned_from_its_first_tokens_and_forgotten_with_time() -> None:
    clock = Clock()
    p = policy(clock)
    local, _ = fleet()
    request = route(words(2000))
    n = request.prompt_tokens
    assert p.choose(request, [local[0]]) is local[0]
    p.observe(
        request, local[0], RouteOutcome(ok=True, prompt_tokens=n, ttft_ms=0.5 * n, first_token=True)
    )  # 5x the prior
    learned = p.ms_per_token(local[0])
    assert learned == pytest.approx(0.1 * 5**p.settings.speed_alpha), "one 5x sample moves it by 5**alpha"
    clock.now += p.settings.speed_half_life_s
    assert p.ms_per_token(local[0]) == pytest.approx(0.1 + (learned - 0.1) / 2)


def test_noisy_first_tokens_teach_the_typical_slowness_not_their_mean() -> None:
    """First tokens of a replica twice as slow as its prior, some landing early in an engine iteration
    (1x) and some late (4x): what is learned is their geometric mean, 2x, where an average of the
    ratios would settle at 2.5x and rank the replica slower than it is."""
    clock = Clock()
    p = policy(clock)
    local, _ = fleet()
    for i in range(400):
        request = route(words(2000, f"n{i}"), key=f"n{i}")
        n = request.prompt_tokens
        assert p.choose(request, [local[0]]) is local[0]
        ratio = 1.0 if i % 2 else 4.0
        p.observe(
            request,
            local[0],
            RouteOutcome(ok=True, prompt_tokens=n, ttft_ms=ratio * 0.1 * n, first_token=True),
        )
        local[0].outstanding_prefill_tokens = 0
    assert p.slowness(local[0]) == pytest.approx(2.0, rel=0.1)


def test_a_replica_twice_as_fast_may_hold_twice_the_requests_before_its_shoppers_move() -> None:
    """Bounded load in capacity shares: prefix_aware's bound counts requests as if every replica were
    as fast, so on a mixed fleet it moves shoppers off a warm fast replica that is only carrying its
    share."""
    fast, slow = Endpoint("http://f", "fast"), Endpoint("http://s", "slow")
    p = PredictedTtftPolicy(
        PredictedTtftSettings(
            groups=[
                EndpointGroup(name="local", endpoints=["http://f"], ms_per_token=0.1),
                EndpointGroup(name="slow", endpoints=["http://s"], ms_per_token=0.2),
            ],
            slo_ms=100_000,
            first_token_floor_ms=0,
        )
    )
    history = words(3000, "h")
    first = route(history, key="warm")
    assert p.choose(first, [fast]) is fast
    p.prefill_done(first, fast)  # its prefix is now on the fast one
    fast.outstanding = 6  # of 7 in flight with this request: uniform bound max(2, ceil(1.5 x 7 / 2)) = 6
    assert p.prefix.load_bound([fast, slow]) == 6
    assert p.prefix.load_bounds([fast, slow], lambda e: 1 / p.ms_per_token(e)) == {"fast": 7, "slow": 4}
    again = route(history + words(100, "n"), key="warm")
    assert p.choose(again, [fast, slow]) is fast, "in capacity shares the fast replica is under its bound"
    assert p.prefix.stats.bounded_load_skips == 0
    uniform = PrefixAwarePolicy()
    first = route(history, key="warm")
    uniform.choose(first, [fast])
    uniform.prefill_done(first, fast)
    assert uniform.choose(route(history + words(100, "n"), key="warm"), [fast, slow]) is slow
    assert uniform.stats.bounded_load_skips == 1


def test_a_spilled_shopper_keeps_its_remote_replica_while_local_is_hot_then_comes_home() -> None:
    clock = Clock()
    p = policy(clock)
    local, remote = fleet()
    endpoints = [*local, *remote]
    for e in local:
        e.outstanding_prefill_tokens = 20_000
    history = words(3000)
    first = route(history, key="shopper")
    home = p.choose(first, endpoints)
    assert home in remote
    p.observe(
        first, home, RouteOutcome(ok=True, prompt_tokens=first.prompt_tokens, ttft_ms=1.0, first_token=True)
    )
    other = next(e for e in remote if e is not home)
    other.outstanding_prefill_tokens = 0
    home.outstanding_prefill_tokens = 1500  # busier than the other remote replica, but warm
    again = p.choose(route(history + words(200, "n"), key="shopper"), endpoints)
    assert again is home, "the warm prefix outweighs the other region replica's shorter queue"
    for e in local:
        e.outstanding_prefill_tokens = 0
    clock.now += p.settings.min_spill_s
    assert p.choose(route(history + words(400, "n"), key="shopper"), endpoints) in local


def test_a_first_token_floor_keeps_an_idle_replica_with_a_warm_prompt_from_looking_slow() -> None:
    clock = Clock()
    p = PredictedTtftPolicy(
        PredictedTtftSettings(
            groups=[EndpointGroup(name="local", endpoints=["http://local0"], ms_per_token=0.1)],
            first_token_floor_ms=100,
            min_work_tokens=1,
        ),
        clock=clock,
    )
    (replica,) = [Endpoint("http://local0", "local0")]
    request = route(words(600))
    n = request.prompt_tokens
    assert p.predicted_ttft_ms(request, replica) == pytest.approx(100 + 0.1 * n)
    assert p.choose(request, [replica]) is replica
    # Exactly what the calibration predicts for this little work: the floor plus the prefill.
    p.observe(
        request, replica, RouteOutcome(ok=True, prompt_tokens=n, ttft_ms=100 + 0.1 * n, first_token=True)
    )
    assert p.slowness(replica) == pytest.approx(1.0), "as fast as its kind: nothing learned"
    # Without the floor the same first token would read as ms per token of work: 1 + 100 / (0.1 n) x.
    assert (100 + 0.1 * n) / (0.1 * n) > 1.5


def test_settings_refuse_an_endpoint_in_two_groups_and_the_policy_is_registered() -> None:
    with pytest.raises(ValueError, match=r"return_ratio 0\.8 must be under spill_ratio 0\.8"):
        PredictedTtftSettings(spill_ratio=0.8, return_ratio=0.8)
    with pytest.raises(ValueError, match="in groups a and b"):
        PredictedTtftSettings(
            groups=[
                EndpointGroup(name="a", endpoints=["http://x"]),
                EndpointGroup(name="b", endpoints=["http://x"]),
            ]
        )
    assert isinstance(make_policy("predicted_ttft", slo_ms=500), PredictedTtftPolicy)


async def test_against_simulators_a_slow_local_region_spills_keeps_affinity_and_comes_back() -> None:
    """Two local replicas 80x slow (an overloaded or slower accelerator), two replicas 40 ms away:
    the policy learns the local speed from first tokens, spills, keeps each shopper on its warm remote
    replica, and comes home once the local replicas are fast again and the learned slowness has aged."""
    local_sims, east_sims = (
        SimulatorFleet(2, "--time-scale", "0.01", "--slowdown", "80"),
        SimulatorFleet(2, "--time-scale", "0.01", "--network-rtt-ms", "40"),
    )
    async with local_sims, east_sims:
        prior = 0.122 * 0.01  # the calibration's ms per prefill token, at this time scale
        settings = PredictedTtftSettings(
            groups=[
                EndpointGroup(name="local", endpoints=local_sims.urls, ms_per_token=prior),
                EndpointGroup(name="east", endpoints=east_sims.urls, rtt_ms=40, ms_per_token=prior),
            ],
            slo_ms=50,
            min_spill_s=1.0,
            speed_half_life_s=1.5,
            min_work_tokens=64,
            speed_alpha=0.5,  # an 80x slowdown is no noise: learn it from the eight first tokens below
            first_token_floor_ms=100 * 0.01,  # the default's engine iteration, at this time scale
        )
        config = ClientConfig.model_validate(
            {
                "endpoints": [*local_sims.urls, *east_sims.urls],
                "policy": "predicted_ttft",
                "timeouts": {"connect_s": 1, "attempt_s": 20, "deadline_s": 30},
                "health": {"interval_s": 0.2},
            }
        )
        policy = PredictedTtftPolicy(settings)
        async with LLMClient(config, policy) as client:
            await client.wait_until_healthy()
            east_names = {e.name for e in client.endpoints if e.url in east_sims.urls}
            for i in range(8):  # cold shoppers: local first, until its first tokens show it is slow
                await client.chat(prompt(f"warmup{i}", 40), routing_key=f"warmup{i}", max_tokens=5)
            first = await client.chat(prompt("alice", 40), routing_key="alice", max_tokens=5)
            assert policy.spilling and policy.stats.spills == 1
            second = await client.chat(prompt("alice", 48), routing_key="alice", max_tokens=5)
            assert first.endpoint in east_names and second.endpoint == first.endpoint
            assert second.cached_tokens > 0.5 * second.prompt_tokens
            async with aiohttp.ClientSession() as session:
                for url in local_sims.urls:
                    async with session.post(f"{url}/admin/config", json={"slowdown": 1.0}) as response:
                        assert response.status == 200
            await asyncio.sleep(6.0)  # past min_spill_s, and four half-lives of the learned slowness
            back = await client.chat(prompt("bob", 40), routing_key="bob", max_tokens=5)
            assert back.endpoint not in east_names and policy.stats.returns == 1


def prompt(shopper: str, events: int) -> list[dict[str, str]]:
    return viewed_prompt(shopper, events, item="costume", category="Costumes > Kids")


# ---- what the learned state must not learn ----------------------------------------------------------------
def test_a_non_streamed_answer_teaches_no_slowness() -> None:
    """A non-streamed answer's time is its whole decode: learnt as a first token, sixty 6.3 s answers
    made a replica 11x slow and the policy stayed spilled with local replicas idle."""
    p = policy(Clock())
    local, _ = fleet()
    for i in range(20):
        request = route(words(2000, f"b{i}"), key=f"b{i}")
        assert p.choose(request, [local[0]]) is local[0]
        whole = RouteOutcome(ok=True, prompt_tokens=request.prompt_tokens, ttft_ms=50 * request.prompt_tokens)
        p.observe(request, local[0], whole)
        local[0].outstanding_prefill_tokens = 0
    assert p.slowness(local[0]) == 1.0 and p.stats.speed_samples == 0


def test_a_retry_with_no_local_candidate_left_does_not_spill_every_request() -> None:
    """A retry's candidates leave out what it tried: after a 503 from the only local replica, the retry
    saw no local replica at all and spilled every request for min_spill_s."""
    p = policy(Clock())
    local, remote = fleet()
    request = route(words(2000))
    assert p.group(p.choose(request, [local[0], *remote])) == "local"
    p.observe(request, local[0], RouteOutcome(ok=False))
    assert p.group(p.choose(request, remote)) == "east"  # the retry goes where it can
    assert not p.spilling and p.stats.spills == 0
    assert p.group(p.choose(route(words(2000), key="next"), [local[0], *remote])) == "local"


def test_a_group_url_with_a_trailing_slash_is_the_replica_the_client_names_without_it() -> None:
    """The client drops a URL's trailing slash: a group URL written with one matched no replica, which
    then counted as local at a round trip of 0."""
    settings = PredictedTtftSettings(
        groups=[EndpointGroup(name="east", endpoints=["http://east0:8000/"], rtt_ms=60)]
    )
    p = PredictedTtftPolicy(settings)
    (replica,) = LLMClient(ClientConfig(endpoints=["http://east0:8000/"])).endpoints
    assert p.group(replica) == "east" and p.rtt_ms(replica) == 60


def test_a_forgotten_replica_loses_its_learned_slowness() -> None:
    """``forget`` (a restart found, an ejection, leaving the fleet) kept the learned slowness: a
    restarted replica was still avoided as the slow process it replaced."""
    p = policy(Clock())
    local, _ = fleet()
    request = route(words(2000))
    assert p.choose(request, [local[0]]) is local[0]
    n = request.prompt_tokens
    p.observe(request, local[0], RouteOutcome(ok=True, prompt_tokens=n, ttft_ms=0.5 * n, first_token=True))
    assert p.slowness(local[0]) > 1.0
    p.forget(local[0])
    assert p.slowness(local[0]) == 1.0


async def test_the_client_learns_no_slowness_from_answers_it_did_not_stream() -> None:
    """Against a simulator replica: non-streamed answers teach nothing, streamed ones do."""
    text = words(2000)
    settings = {"policy": "predicted_ttft", "first_token_floor_ms": 0}
    async with SimulatorFleet(1, "--time-scale", "0.01") as replicas:
        for stream in (False, True):
            config = ClientConfig(endpoints=replicas.urls, policy_settings=settings, stream=stream)
            async with LLMClient(config) as client:
                for i in range(3):
                    await client.chat(
                        [{"role": "user", "content": f"{i}{text}"}], routing_key=f"s{i}", max_tokens=40
                    )
                policy = client.policy
                assert isinstance(policy, PredictedTtftPolicy)
                assert (policy.stats.speed_samples > 0) == stream, stream
