"""Unit and property tests of the pure routing logic: PrefixAwarePolicy and DegradationDetector."""

from __future__ import annotations

import collections
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_client import ClientConfig, LLMClient
from llm_client.degradation import DegradationDetector, DegradationSettings, apply_health_changes
from llm_client.endpoints import Endpoint
from llm_client.kv_events import parse_events
from llm_client.routing import POLICIES, make_policy
from llm_client.routing.base import RouteOutcome, RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy, ReplicaBlockIndex
from llm_client.routing.session_affinity import rendezvous_order
from prompt_assembly.prompt import build_messages
from prompt_assembly.tokens import count_tokens, messages_text


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"http://r{i}", f"r{i}") for i in range(n)]


def shopper_prompt(shopper: str, events: int) -> RouteRequest:
    lines = [
        f"- 2026-11-22 10:{i % 60:02d} viewed: <data>{shopper} item number {i} in a long title</data> by "
        f"Brand{i % 7}, Home > Kitchen, ${i}.99\n"
        for i in range(events)
    ]
    text = messages_text(build_messages(shopper, lines))
    return RouteRequest(shopper, text, count_tokens(text), 200)


def route(policy: PrefixAwarePolicy, request: RouteRequest, eps: list[Endpoint]) -> Endpoint:
    """What the client does around one successful attempt, minus the HTTP."""
    chosen = policy.choose(request, eps)
    cached = request.prompt_tokens - policy.estimate_uncached_tokens(request, chosen)
    policy.observe(request, chosen, RouteOutcome(True, request.prompt_tokens, cached))
    return chosen


# ---- registration and knobs --------------------------------------------------------------------------
def test_registered_and_configured_by_typed_settings() -> None:
    assert POLICIES["prefix_aware"] is PrefixAwarePolicy
    policy = make_policy("prefix_aware", block_size=64, max_blocks_per_replica=100, load_factor=1.5)
    assert isinstance(policy, PrefixAwarePolicy)
    assert policy.block_size == 64 and policy.max_blocks_per_replica == 100
    assert policy.restart_max_cached_tokens == 64  # defaults to one block
    with pytest.raises(ValueError):
        make_policy("prefix_aware", load_factr=1.5)  # a misspelt knob is an error, not ignored
    with pytest.raises(ValueError):
        make_policy("prefix_aware", block_size=32.5)  # an integer knob takes no fraction


def test_config_selects_the_policy_by_name_and_types_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_client.config import ClientConfig
    from runner.config import RunnerSettings

    monkeypatch.setenv("RUNNER_LLM__POLICY", "prefix_aware")
    monkeypatch.setenv("RUNNER_LLM__POLICY_SETTINGS", '{"policy": "prefix_aware", "kv_events": "precise"}')
    llm = RunnerSettings().llm
    assert llm.policy == "prefix_aware"
    built = make_policy(llm.routing())
    assert isinstance(built, PrefixAwarePolicy) and built.kv_event_poll_s is not None
    # a name alone gives that policy's defaults; settings alone select their policy
    assert ClientConfig(policy="round_robin").routing().policy == "round_robin"
    assert ClientConfig(policy_settings={"policy": "session_affinity"}).policy == "session_affinity"
    with pytest.raises(ValueError, match="policy_settings are for"):
        ClientConfig(policy="round_robin", policy_settings={"policy": "prefix_aware"})


@pytest.mark.parametrize(
    "bad", [{"load_factor": 0.9}, {"block_size": 0}, {"imbalance_ratio": 0.5}, {"prefill_weight": -1}]
)
def test_rejects_bad_knobs(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PrefixAwarePolicy(None, **bad)  # type: ignore[arg-type]  # knobs by keyword, validated at run time


def test_block_index_is_lru_bounded_and_prefix_matched() -> None:
    index = ReplicaBlockIndex(capacity=4)
    index.insert([1, 2, 3])
    assert index.longest_prefix([1, 2, 3, 4]) == 3
    index.insert([9, 8])  # 5 blocks > 4: the least recently used leaf (3) goes first
    assert len(index) == 4
    assert index.longest_prefix([1, 2, 3]) == 2
    assert index.longest_prefix([7, 1, 2]) == 0  # a lookup stops at the first missing block
    index.remove([1])
    assert index.longest_prefix([1, 2]) == 0 and len(index) == 3


# ---- cache following ---------------------------------------------------------------------------------
def test_prefers_the_replica_holding_the_prefix() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(8)
    first = route(policy, shopper_prompt("alice", 40), eps)
    for grown in (45, 50, 60):
        request = shopper_prompt("alice", grown)
        assert route(policy, request, eps) is first
        # the estimate handed to the client's load accounting is the uncached tail only
        assert policy.estimate_uncached_tokens(request, first) < 0.3 * request.prompt_tokens
    assert policy.stats.cache_hits == 3


def test_follows_the_cache_over_a_moderate_load_difference() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(4)
    home = route(policy, shopper_prompt("bob", 60), eps)
    home.outstanding, home.outstanding_decode_tokens = 1, 200  # busier than the idle others
    assert policy.choose(shopper_prompt("bob", 62), eps) is home


def test_bounded_load_overrides_the_cache() -> None:
    policy, eps = PrefixAwarePolicy(load_factor=1.25), endpoints(4)
    home = route(policy, shopper_prompt("carol", 60), eps)
    home.outstanding = 6  # bound = max(2, ceil(1.25 * 7 / 4)) = 3
    chosen = policy.choose(shopper_prompt("carol", 61), eps)
    assert chosen is not home
    assert policy.stats.bounded_load_skips == 1


def test_imbalance_falls_back_to_power_of_two_choices() -> None:
    policy, eps = (
        PrefixAwarePolicy(
            imbalance_abs_tokens=1000,
            imbalance_ratio=2.0,
            load_factor=100,
            max_queued_tokens=1e9,  # the other guards off: only the imbalance test decides
        ),
        endpoints(4),
    )
    home = route(policy, shopper_prompt("dave", 60), eps)
    home.outstanding_prefill_tokens = 50_000  # far more than anyone: the cluster is imbalanced
    picks = collections.Counter(policy.choose(shopper_prompt("dave", 61), eps).name for _ in range(40))
    assert home.name not in picks  # the less loaded of two samples is never the overloaded one
    assert len(picks) >= 2 and policy.stats.imbalance_fallbacks == 40


def test_a_hot_shopper_spreads_to_a_second_replica_once_it_holds_its_share() -> None:
    policy, eps = (
        PrefixAwarePolicy(load_factor=100, hot_key_spread=True, hot_key_min_inflight=3, hot_key_share=0.01),
        endpoints(4),
    )
    home = route(policy, shopper_prompt("hot", 60), eps)
    picks = [policy.choose(shopper_prompt("hot", 61 + i), eps) for i in range(3)]  # in flight, unanswered
    assert picks == [home] * 3  # its cache wins while it runs fewer than 3 there
    second = policy.choose(shopper_prompt("hot", 64), eps)
    assert second is not home and policy.stats.hot_key_spreads == 1
    # the second replica now holds the shopper too: the next spill goes there, warm
    third = policy.choose(shopper_prompt("hot", 65), eps)
    assert third is second
    assert policy.estimate_uncached_tokens(shopper_prompt("hot", 65), third) < 0.3 * 3000
    # answers free the home replica's slots: the shopper goes home again
    for i in range(3):
        request = shopper_prompt("hot", 61 + i)
        policy.observe(request, home, RouteOutcome(True, request.prompt_tokens, 0))
    assert policy.choose(shopper_prompt("hot", 66), eps) in (home, second)


def test_a_hot_shopper_stays_on_its_holder_by_default() -> None:
    policy, eps = PrefixAwarePolicy(load_factor=100, hot_key_min_inflight=3, hot_key_share=0.01), endpoints(4)
    home = route(policy, shopper_prompt("hot", 60), eps)
    picks = [policy.choose(shopper_prompt("hot", 61 + i), eps) for i in range(5)]
    assert picks == [home] * 5 and policy.stats.hot_key_spreads == 0


def test_a_long_prefill_queue_is_not_a_candidate() -> None:
    policy, eps = PrefixAwarePolicy(max_queued_tokens=10_000), endpoints(3)
    home = route(policy, shopper_prompt("ida", 60), eps)
    home.outstanding_prefill_tokens = 12_000  # more than the cap: its cache no longer pays for the wait
    assert policy.choose(shopper_prompt("ida", 61), eps) is not home
    assert policy.stats.queue_cap_skips == 1


def test_kv_room_guard_moves_a_prompt_off_a_replica_whose_kv_memory_is_booked_full() -> None:
    """Each request in flight books prompt + max_tokens of KV memory, as GUARANTEED_NO_EVICT admits it;
    a third request of the shopper would wait for memory on its home replica, so it goes elsewhere;
    once an answer frees room, home is a candidate again. Off by default: the cache wins."""
    need = shopper_prompt("kim", 63).prompt_tokens + 200
    blocks = math.ceil(2.5 * need / 32)  # room for two such requests, not three
    for guard in (True, False):
        policy, eps = (
            PrefixAwarePolicy(load_factor=100, max_blocks_per_replica=blocks, kv_room_guard=guard),
            endpoints(4),
        )
        home = route(policy, shopper_prompt("kim", 60), eps)  # answered: books nothing any more
        first, second = (shopper_prompt("kim", 61 + i) for i in range(2))
        assert [policy.choose(r, eps) for r in (first, second)] == [home, home]  # in flight there
        third = policy.choose(shopper_prompt("kim", 63), eps)
        assert (third is not home) == guard and policy.stats.kv_room_skips == int(guard)
        cached = first.prompt_tokens - policy.estimate_uncached_tokens(first, home)
        policy.observe(first, home, RouteOutcome(True, first.prompt_tokens, cached))  # room again at home
        fourth = policy.choose(shopper_prompt("kim", 64), eps)
        assert fourth in (home, third) and policy.stats.kv_room_skips == int(guard)  # no skip now


def test_precise_mode_takes_each_replicas_kv_capacity_from_its_created_event() -> None:
    policy, eps = PrefixAwarePolicy(kv_events="precise", max_blocks_per_replica=100), endpoints(2)
    created = {"type": "created", "num_blocks_per_cache_level": [1848, 0]}
    raw = json.dumps([{"event_id": 0, "window_size": 32768, "data": created}]).encode()
    policy.apply_kv_events(eps[0], parse_events(raw))
    assert policy.kv_capacity_tokens(eps[0]) == 1848 * 32
    assert policy.kv_capacity_tokens(eps[1]) == 100 * 32  # no event yet: the configured bound


def test_spreads_cold_shoppers() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(8)
    counts = collections.Counter(route(policy, shopper_prompt(f"s{i}", 30), eps).name for i in range(400))
    assert len(counts) == 8 and max(counts.values()) < 2 * 400 / 8


# ---- corrections -------------------------------------------------------------------------------------
def test_restart_detected_when_a_hit_comes_back_empty() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(3)
    home = route(policy, shopper_prompt("erin", 60), eps)
    other = next(e for e in eps if e is not home)
    policy.index(other).insert(policy.block_hashes(shopper_prompt("frank", 60)))
    policy.index(home).insert(policy.block_hashes(shopper_prompt("frank", 60)))
    request = shopper_prompt("erin", 62)
    assert policy.choose(request, eps) is home
    feedback = policy.observe(request, home, RouteOutcome(True, request.prompt_tokens, cached_tokens=0))
    assert feedback.restart_detected and policy.stats.restarts_detected == 1
    assert home.restarts_detected == 0  # the policy reports; only the client writes the Endpoint
    # the index was cleared (frank's blocks are gone from it only), then refilled with the prompt the
    # replica just computed
    assert policy.cached_tokens(shopper_prompt("frank", 60), home) < 0.3 * request.prompt_tokens
    assert policy.cached_tokens(shopper_prompt("frank", 60), other) > 0.9 * request.prompt_tokens
    assert policy.cached_tokens(shopper_prompt("erin", 62), home) > 0


def test_a_new_shopper_missing_the_shared_head_is_not_a_restart() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(2)
    route(policy, shopper_prompt("ivan", 40), eps)
    request = shopper_prompt("judy", 40)  # only the system-prompt head is believed held anywhere
    chosen = policy.choose(request, eps)
    feedback = policy.observe(request, chosen, RouteOutcome(True, request.prompt_tokens, cached_tokens=0))
    assert not feedback.restart_detected and policy.stats.restarts_detected == 0


def test_partial_hits_are_not_restarts_and_units_are_shares() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(2)
    home = route(policy, shopper_prompt("gina", 60), eps)
    request = shopper_prompt("gina", 61)
    assert policy.choose(request, eps) is home
    # a server with another tokenizer: 3x the token count, same cached share
    feedback = policy.observe(
        request, home, RouteOutcome(True, 3 * request.prompt_tokens, 2 * request.prompt_tokens)
    )
    assert not feedback.restart_detected


def test_failed_attempt_takes_back_the_recorded_blocks() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(2)
    request = shopper_prompt("hugo", 60)
    chosen = policy.choose(request, eps)
    assert policy.cached_tokens(shopper_prompt("hugo", 60), chosen) > 0
    policy.observe(request, chosen, RouteOutcome(ok=False))
    assert policy.cached_tokens(shopper_prompt("hugo", 60), chosen) == 0


def test_forget_clears_only_that_replica() -> None:
    policy, eps = PrefixAwarePolicy(), endpoints(4)
    homes = {s: route(policy, shopper_prompt(s, 50), eps) for s in ("a", "b", "c", "d", "e", "f")}
    gone = homes["a"]
    policy.forget(gone)
    assert len(policy.index(gone)) == 0
    assert any(len(policy.index(e)) > 0 for e in eps if e is not gone)


def test_a_fleet_that_replaces_its_replicas_keeps_no_belief_about_those_gone() -> None:
    """A gateway whose replicas come and go under new names (pods) forgets each one it drops
    (``Fleet.set_endpoints``): its traffic share went with it too, not only its cache index."""
    policy = PrefixAwarePolicy()
    for generation in range(3):
        eps = [Endpoint(f"http://gen{generation}-r{i}:8000", f"gen{generation}-r{i}") for i in range(3)]
        for shopper in ("a", "b", "c", "d"):
            route(policy, shopper_prompt(shopper, 30), eps)
        assert policy.replicas_known() == {e.name for e in eps}
        for endpoint in eps:
            policy.forget(endpoint)
    assert policy.replicas_known() == set()


# ---- properties --------------------------------------------------------------------------------------
keys = st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=keys, n=st.integers(2, 10), events=st.integers(5, 40))
def test_deterministic_for_a_key(key: str, n: int, events: int) -> None:
    a = PrefixAwarePolicy().choose(shopper_prompt(key, events), endpoints(n))
    b = PrefixAwarePolicy().choose(shopper_prompt(key, events), endpoints(n))
    assert a.name == b.name


@settings(max_examples=12, deadline=None)
@given(n=st.integers(3, 10), leaving=st.integers(0, 9))
def test_few_keys_move_when_a_replica_leaves(n: int, leaving: int) -> None:
    leaving %= n
    eps = endpoints(n)
    shoppers = [f"shopper{i}" for i in range(60)]
    # With no cache knowledge and equal load, the choice is the key's rendezvous order:
    before = {s: PrefixAwarePolicy().choose(shopper_prompt(s, 8), eps).name for s in shoppers}
    rest = [e for i, e in enumerate(eps) if i != leaving]
    after = {s: PrefixAwarePolicy().choose(shopper_prompt(s, 8), rest).name for s in shoppers}
    moved = {s for s in shoppers if before[s] != after[s]}
    assert moved == {s for s in shoppers if before[s] == eps[leaving].name}

    # With cache knowledge, a shopper stays where its prefix is unless that replica left.
    policy = PrefixAwarePolicy(load_factor=100)
    homes = {s: route(policy, shopper_prompt(s, 30), eps).name for s in shoppers}
    for s in shoppers:
        policy_choice = policy.choose(shopper_prompt(s, 31), rest).name
        if homes[s] != eps[leaving].name:
            assert policy_choice == homes[s]


@settings(max_examples=40, deadline=None)
@given(
    loads=st.lists(st.integers(0, 30), min_size=2, max_size=10),
    factor=st.floats(1.0, 2.0),
    key=keys,
)
def test_bounded_load_holds(loads: list[int], factor: float, key: str) -> None:
    eps = endpoints(len(loads))
    for e, load in zip(eps, loads, strict=True):
        e.outstanding = load
    policy = PrefixAwarePolicy(load_factor=factor)
    for e in eps:  # every replica claims the prompt: only load can decide
        policy.index(e).insert(policy.block_hashes(shopper_prompt(key, 20)))
    chosen = policy.choose(shopper_prompt(key, 20), eps)
    total = sum(loads) + 1
    assert chosen.outstanding < max(2, -(-factor * total // len(eps)))
    assert policy.load_bound(eps) == max(2, -(-factor * total // len(eps)))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000))
def test_bounded_load_under_a_hot_shopper(seed: int) -> None:
    """Requests of one hot shopper that never finish still spread once its home is full."""
    eps, policy = endpoints(4), PrefixAwarePolicy(seed=seed)
    for i in range(40):
        chosen = policy.choose(shopper_prompt("hot", 30 + i), eps)
        chosen.outstanding += 1
    mean = sum(e.outstanding for e in eps) / len(eps)
    assert max(e.outstanding for e in eps) <= policy.load_factor * mean + 2


# ---- degradation detector ----------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(detector: DegradationDetector, eps: list[Endpoint], slow: dict[str, float], rounds: int) -> None:
    for _ in range(rounds):
        for e in eps:
            if e.routable:
                latency = 1000.0 * slow.get(e.name, 1.0)
                detector.observe_success(
                    e, latency, prompt_tokens=3000, cached_tokens=2900, completion_tokens=200
                )
        evaluate(detector, eps)


def evaluate(detector: DegradationDetector, eps: list[Endpoint]) -> list[str]:
    """What the client does: the detector decides, the client applies."""
    changes = detector.evaluate(eps)
    apply_health_changes(eps, changes)
    return [c.action for c in changes]


def test_slow_replica_is_drained_reported_and_readmitted_after_cooldown() -> None:
    clock, eps = FakeClock(), endpoints(4)
    detector = DegradationDetector(DegradationSettings(min_samples=10, cooldown_s=30), clock=clock)
    feed(detector, eps, {"r2": 5.0}, rounds=30)
    assert [e.name for e in eps if e.drained] == ["r2"]
    assert detector.drains == 1 and eps[2].extra["drains"] == 1
    assert detector.changes[0].action == "drained" and "latency" in detector.changes[0].reason
    clock.now = 31
    assert evaluate(detector, eps) == ["readmitted"]
    assert not eps[2].drained
    # still slow on probation: drained again, for twice as long
    feed(detector, eps, {"r2": 5.0}, rounds=30)
    assert eps[2].drained and detector.drains == 2
    clock.now = 31 + 31
    evaluate(detector, eps)
    assert eps[2].drained
    clock.now = 31 + 61
    evaluate(detector, eps)
    assert not eps[2].drained


def test_a_quarantined_replica_counts_neither_as_routable_nor_as_a_peer() -> None:
    """Two of four replicas quarantined for bad answers (``answer_health``) leave two routable, the
    least ``min_routable`` keeps: a slow one among them stays. Counted as routable, the quarantined
    ones let the detector drain it, leaving one replica for the whole fleet's traffic."""
    eps = endpoints(4)
    detector = DegradationDetector(DegradationSettings(min_samples=10, min_routable=2, min_peers=1))
    for _ in range(30):
        for e in eps:
            latency = 5000.0 if e.name == "r2" else 1000.0
            detector.observe_success(
                e, latency, prompt_tokens=3000, cached_tokens=2900, completion_tokens=200
            )
    eps[0].quarantined = eps[1].quarantined = True
    evaluate(detector, eps)
    assert [e.name for e in eps if e.routable] == ["r2", "r3"]


def test_a_replica_that_left_and_came_back_is_judged_afresh() -> None:
    """Capacity shifting moves a replica out of a client's pool and back (``set_endpoints``). Its
    degradation signals stayed: the replica came back already judged, on the latencies of whatever ran
    there before, and addresses that churn piled up. They go with the replica now."""
    client = LLMClient(ClientConfig(endpoints=["http://a:1", "http://b:1"]))
    detector = client.fleet.degradation
    for _ in range(30):
        detector.observe_success(
            client.endpoints[1], 5000.0, prompt_tokens=100, cached_tokens=0, completion_tokens=50
        )
    assert detector.signals(client.endpoints[1]).samples == 30
    client.set_endpoints(["http://a:1"])
    client.set_endpoints(["http://a:1", "http://b:1"])
    assert detector.signals(client.endpoints[1]).samples == 0


def test_erroring_replica_is_drained() -> None:
    eps = endpoints(4)
    detector = DegradationDetector(DegradationSettings(min_samples=10))
    for _ in range(30):
        for e in eps:
            if e.name == "r1":
                detector.observe_failure(e)
            else:
                detector.observe_success(e, 500.0, prompt_tokens=100, cached_tokens=0, completion_tokens=50)
        evaluate(detector, eps)
    assert [e.name for e in eps if e.drained] == ["r1"]
    assert "error rate" in detector.changes[0].reason


def test_uniform_slowness_and_noise_drain_nothing() -> None:
    eps = endpoints(5)
    detector = DegradationDetector(DegradationSettings(min_samples=5))
    feed(detector, eps, {e.name: 4.0 for e in eps}, rounds=20)
    feed(detector, eps, {"r0": 1.5, "r3": 0.7}, rounds=20)
    assert not any(e.drained for e in eps) and detector.drains == 0


def test_never_drains_below_the_minimum() -> None:
    eps = endpoints(3)
    detector = DegradationDetector(DegradationSettings(min_samples=5, min_routable=2, min_peers=1))
    feed(detector, eps, {"r0": 10.0, "r1": 10.0}, rounds=20)
    assert sum(e.drained for e in eps) <= 1


def test_disabled_detector_does_nothing() -> None:
    eps = endpoints(4)
    detector = DegradationDetector(DegradationSettings(enabled=False, min_samples=1))
    feed(detector, eps, {"r0": 50.0}, rounds=10)
    assert not any(e.drained for e in eps)


def test_a_cold_answer_while_the_keys_previous_prompt_was_prefilling_is_not_a_restart() -> None:
    # Long after one another: the co-batching window (tests below) would expect the cold answer anyway.
    policy, eps = PrefixAwarePolicy(cobatch_window_s=0), endpoints(2)
    earlier = shopper_prompt("kim", 60)
    home = policy.choose(earlier, eps)  # routed, prefill not reported done
    request = shopper_prompt("kim", 62)
    assert policy.choose(request, eps) is home
    feedback = policy.observe(request, home, RouteOutcome(True, request.prompt_tokens, cached_tokens=0))
    assert not feedback.restart_detected and policy.stats.restart_checks_skipped == 1
    # The earlier prompt's prefill ends: the next cold answer there is evidence again.
    policy.prefill_done(earlier, home)
    policy.prefill_done(earlier, home)  # idempotent
    policy.observe(earlier, home, RouteOutcome(True, earlier.prompt_tokens, 0))
    later = shopper_prompt("kim", 64)
    assert policy.choose(later, eps) is home
    assert policy.observe(later, home, RouteOutcome(True, later.prompt_tokens, 0)).restart_detected


def test_matches_resting_on_a_pending_prefill_are_ignored_once_they_come_back_cold() -> None:
    # The prompts come long after one another here (the co-batching window is the next tests' subject).
    policy, eps = PrefixAwarePolicy(pending_hit_alpha=0.6, cobatch_window_s=0), endpoints(2)
    first = shopper_prompt("lena", 60)
    home = policy.choose(first, eps)
    home.outstanding_prefill_tokens = 500  # the client counts the attempt's expected prefill
    second = shopper_prompt("lena", 61)
    assert policy.choose(second, eps) is home  # nothing learned yet: the belief is followed
    policy.observe(second, home, RouteOutcome(True, second.prompt_tokens, cached_tokens=0))
    assert policy.stats.pending_hit_rate < 0.5 and policy.stats.restarts_detected == 0
    # The first prompt is still being prefilled on home: the third goes where it does not queue behind it.
    third = shopper_prompt("lena", 62)
    assert policy.choose(third, eps) is not home and policy.stats.pending_matches_ignored == 1
    # Once the first prompt's prefill is over, home's blocks count again.
    policy.prefill_done(first, home)
    home.outstanding_prefill_tokens = 0
    assert policy.choose(shopper_prompt("lena", 63), eps) is home


def test_warm_answers_during_a_pending_prefill_keep_the_belief() -> None:
    policy, eps = PrefixAwarePolicy(pending_hit_alpha=0.6, cobatch_window_s=0), endpoints(2)
    first = shopper_prompt("mona", 60)
    home = policy.choose(first, eps)
    for events in (61, 62, 63):  # an engine that stored the blocks before the next prompt came
        request = shopper_prompt("mona", events)
        assert policy.choose(request, eps) is home
        cached = request.prompt_tokens - policy.estimate_uncached_tokens(request, home)
        policy.observe(request, home, RouteOutcome(True, request.prompt_tokens, cached))
    assert policy.stats.pending_hit_rate == 1.0 and policy.stats.pending_matches_ignored == 0


def start(policy: PrefixAwarePolicy, request: RouteRequest, eps: list[Endpoint]) -> Endpoint:
    """What the client does when an attempt starts: choose, then count it in flight on the replica."""
    chosen = policy.choose(request, eps)
    chosen.outstanding += 1
    chosen.outstanding_prefill_tokens += policy.estimate_uncached_tokens(request, chosen)
    return chosen


def first_token(policy: PrefixAwarePolicy, request: RouteRequest, endpoint: Endpoint) -> None:
    """What the client does at an attempt's first streamed token."""
    endpoint.outstanding_prefill_tokens -= policy.estimate_uncached_tokens(request, endpoint)
    policy.prefill_done(request, endpoint)


def end(policy: PrefixAwarePolicy, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
    """What the client does when an attempt ends (its first token already reported if it streamed)."""
    endpoint.outstanding -= 1
    policy.observe(request, endpoint, outcome)


def cobatch_policy(clock: FakeClock) -> PrefixAwarePolicy:
    return PrefixAwarePolicy(clock=clock, cobatch_window_s=0.05)


def home_and_far(clock: FakeClock) -> tuple[PrefixAwarePolicy, Endpoint, Endpoint]:
    """A policy and two replicas, the second out of the question throughout (a huge prefill queue)."""
    home, far = endpoints(2)
    far.outstanding_prefill_tokens = 50_000
    return cobatch_policy(clock), home, far


def test_a_prompt_right_behind_its_cold_sibling_does_not_join_its_iteration() -> None:
    clock, eps = FakeClock(), endpoints(2)
    policy = cobatch_policy(clock)
    for e in eps:
        e.outstanding = 1  # each replica runs decode steps for another request
    first = shopper_prompt("olga", 60)
    home = start(policy, first, eps)  # cold: only the shared head anywhere
    # 20 ms later the next prompt: on home it would be admitted with the first and computed cold too,
    # and both first tokens would wait for both prefills. It is costed cold there and goes where it
    # prefills alone.
    clock.now += 0.02
    second = shopper_prompt("olga", 61)
    assert policy.cached_tokens(second, home) > 0.9 * first.prompt_tokens  # the index has the first
    away = start(policy, second, eps)
    assert away is not home and policy.stats.cobatch_avoided == 1
    # Past the window both are being computed: the next prompt waits for one of them and reuses it.
    clock.now += 0.2
    third = shopper_prompt("olga", 62)
    chosen = policy.choose(third, eps)
    assert policy.estimate_uncached_tokens(third, chosen) < 0.1 * third.prompt_tokens
    assert policy.stats.cobatch_avoided == 1


def test_a_prompt_right_behind_its_sibling_on_an_idle_replica_follows_it() -> None:
    clock = FakeClock()
    policy, home, far = home_and_far(clock)
    first = shopper_prompt("ivy", 60)
    assert start(policy, first, [home, far]) is home  # nothing ran there: admitted at once
    clock.now += 0.02
    second = shopper_prompt("ivy", 61)
    assert policy.choose(second, [home, far]) is home  # waits for the first's iteration, then reuses it
    assert policy.estimate_uncached_tokens(second, home) < 0.1 * second.prompt_tokens
    assert policy.stats.cobatch_avoided == 0


def test_a_sibling_queued_behind_another_prefill_counts_as_queued_until_that_one_is_done() -> None:
    clock = FakeClock()
    policy, home, far = home_and_far(clock)
    other = shopper_prompt("rita", 60)
    assert start(policy, other, [home, far]) is home  # another shopper's prefill, still running
    first = shopper_prompt("sam", 60)
    assert start(policy, first, [home, far]) is home  # cold, queued behind it
    clock.now += 0.5  # far past the window, but the iteration it arrived in has not ended
    second = shopper_prompt("sam", 61)
    assert start(policy, second, [home, far]) is home
    # It joins the first one's iteration: cold, and counted so in the replica's load.
    assert policy.estimate_uncached_tokens(second, home) > 0.8 * second.prompt_tokens
    assert policy.stats.cobatch_avoided == 1
    first_token(policy, other, home)  # that iteration ended: the first two are being computed now
    end(policy, other, home, RouteOutcome(True, other.prompt_tokens, 0))
    clock.now += 0.5
    third = shopper_prompt("sam", 62)
    assert policy.choose(third, [home, far]) is home
    assert policy.estimate_uncached_tokens(third, home) < 0.1 * third.prompt_tokens
    assert policy.stats.cobatch_avoided == 1


def test_a_failed_attempt_neither_ends_an_iteration_nor_removes_its_queued_siblings_blocks() -> None:
    clock = FakeClock()
    policy, home, far = home_and_far(clock)
    other = shopper_prompt("uma", 60)
    start(policy, other, [home, far])
    first = shopper_prompt("vic", 60)
    assert start(policy, first, [home, far]) is home  # queued behind uma's prefill
    second = shopper_prompt("vic", 61)
    assert start(policy, second, [home, far]) is home  # joins the first, costed cold
    # The second attempt fails (a 503): that is no first token, and the first is still queued and will
    # compute its blocks, so they stay in the index.
    end(policy, second, home, RouteOutcome(False))
    assert policy.cached_tokens(first, home) > 0.9 * first.prompt_tokens
    clock.now += 0.5
    third = shopper_prompt("vic", 62)
    assert start(policy, third, [home, far]) is home
    assert policy.estimate_uncached_tokens(third, home) > 0.8 * third.prompt_tokens  # first still queued
    # An attempt that ends without a first token (cancelled, a 4xx) is no iteration's end either.
    policy.prefill_abandoned(third, home)
    assert policy._queued.first_tokens(home.name) == 0
    # A first token and then its observe() count one prefill, not two.
    first_token(policy, other, home)
    end(policy, other, home, RouteOutcome(True, other.prompt_tokens, 0))
    assert policy._queued.first_tokens(home.name) == 1


def test_a_prompt_right_behind_its_warm_sibling_follows_it() -> None:
    clock, eps = FakeClock(), endpoints(2)
    policy = cobatch_policy(clock)
    for e in eps:
        e.outstanding = 1
    home = route(policy, shopper_prompt("pia", 60), eps)
    warm = shopper_prompt("pia", 61)
    assert start(policy, warm, eps) is home  # found the first prompt cached
    found = warm.prompt_tokens - policy.estimate_uncached_tokens(warm, home)
    clock.now += 0.02
    # Admitted together with its sibling it still reuses what the sibling reuses: it follows, and is
    # costed for the sibling's suffix and its own.
    third = shopper_prompt("pia", 62)
    assert policy.choose(third, eps) is home
    assert policy.estimate_uncached_tokens(third, home) == third.prompt_tokens - found
    assert policy.stats.cobatch_avoided == 1


def test_interference_sends_a_cold_prompt_away_from_the_busiest_holder() -> None:
    for weight, away in ((0.0, False), (1.0, True)):
        policy, eps = PrefixAwarePolicy(interference_weight=weight), endpoints(3)
        home = route(policy, shopper_prompt("nico", 40), eps)
        for events in range(41, 61):  # a hot shopper: most recent decisions went to its holder
            assert route(policy, shopper_prompt("nico", events), eps) is home
        for i in range(40):  # a new shopper whose rendezvous order starts at the holder
            newcomer = shopper_prompt(f"new{i}", 40)
            if rendezvous_order(newcomer.key, eps)[0] is home:
                break
        # Equal loads and only the shared head cached anywhere: without the term the tie goes to the
        # newcomer's rendezvous order (the holder); with it, to a replica fewer requests reach.
        assert (policy.choose(newcomer, eps) is not home) is away
