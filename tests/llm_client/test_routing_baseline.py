"""The three baseline policies: round robin, least outstanding, session affinity (rendezvous hashing
with bounded load). Pure unit and property tests: policies do no I/O."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_client.endpoints import Endpoint
from llm_client.routing import POLICIES, RouteRequest, make_policy
from llm_client.routing.session_affinity import SessionAffinityPolicy, rendezvous_order


def replicas(n: int) -> list[Endpoint]:
    return [Endpoint(f"http://10.0.0.{i}:8000", f"replica-{i}") for i in range(n)]


def request(key: str) -> RouteRequest:
    return RouteRequest(key=key, prompt_text=f"prompt of {key}", prompt_tokens=3000, max_tokens=200)


def test_policies_are_chosen_by_name() -> None:
    assert {"round_robin", "least_outstanding", "session_affinity", "prefix_aware"} <= set(POLICIES)
    assert make_policy("session_affinity", load_factor=1.5).load_factor == 1.5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random_guess")


def test_round_robin_cycles() -> None:
    policy, eps = make_policy("round_robin"), replicas(3)
    assert [policy.choose(request("k"), eps).name for _ in range(6)] == [e.name for e in eps] * 2


def test_least_outstanding_picks_the_idlest_and_rotates_ties() -> None:
    policy, eps = make_policy("least_outstanding"), replicas(3)
    eps[0].outstanding, eps[1].outstanding, eps[2].outstanding = 5, 1, 3
    assert policy.choose(request("k"), eps).name == "replica-1"
    for e in eps:
        e.outstanding = 0
    assert len({policy.choose(request("k"), eps).name for _ in range(3)}) == 3


keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=16)


@given(key=keys, n=st.integers(1, 12))
def test_affinity_is_deterministic_for_a_key(key: str, n: int) -> None:
    assert SessionAffinityPolicy().choose(request(key), replicas(n)).name == (
        SessionAffinityPolicy().choose(request(key), replicas(n)).name
    )


@settings(max_examples=30)
@given(n=st.integers(2, 10), leaving=st.integers(0, 9))
def test_only_the_leaving_replicas_keys_move(n: int, leaving: int) -> None:
    eps = replicas(n)
    gone = eps[leaving % n]
    remaining = [e for e in eps if e is not gone]
    policy = SessionAffinityPolicy()
    moved = 0
    for i in range(400):
        before = policy.choose(request(f"shopper-{i}"), eps).name
        after = policy.choose(request(f"shopper-{i}"), remaining).name
        if before != gone.name:
            assert after == before, "a key on a surviving replica must stay"
        else:
            moved += 1
    assert moved < 400 * 2.5 / n  # about 1/n of the keys lived on the leaving replica


@settings(max_examples=50)
@given(loads=st.lists(st.integers(0, 40), min_size=2, max_size=8), factor=st.floats(1.0, 2.0), key=keys)
def test_bounded_load_holds(loads: list[int], factor: float, key: str) -> None:
    eps = replicas(len(loads))
    for e, load in zip(eps, loads, strict=True):
        e.outstanding = load
    chosen = SessionAffinityPolicy(load_factor=factor).choose(request(key), eps)
    bound = max(2, -(-factor * (sum(loads) + 1) // len(eps)))
    if any(e.outstanding < bound for e in eps):
        assert chosen.outstanding < bound
    else:
        assert chosen is rendezvous_order(key, eps)[0]


@pytest.mark.parametrize("n", [3, 8])
def test_a_nearly_idle_fleet_keeps_a_shopper_whose_last_prompt_is_in_flight_at_home(n: int) -> None:
    """With one request in flight the bound was 1: the shopper's own replica, holding its previous
    prompt, was skipped, and the next prompt went to an idle replica and was prefilled cold."""
    eps, policy = replicas(n), SessionAffinityPolicy()
    home = rendezvous_order("shopper-7", eps)[0]
    home.outstanding = 1
    assert policy.choose(request("shopper-7"), eps) is home
    home.outstanding = 2  # past the floor, with the rest idle: bounded load moves the next one
    assert policy.choose(request("shopper-7"), eps) is not home


def test_a_hot_shopper_spills_over_instead_of_piling_up() -> None:
    eps, policy = replicas(4), SessionAffinityPolicy(load_factor=1.25)
    for _ in range(200):  # 200 concurrent requests of one shopper
        policy.choose(request("hot-shopper"), eps).outstanding += 1
    loads = [e.outstanding for e in eps]
    assert max(loads) <= 1.25 * (sum(loads) / len(loads)) + 1
    home = rendezvous_order("hot-shopper", eps)[0]
    assert home.outstanding == max(loads)  # the shopper's own replica still takes the largest share


def test_affinity_spreads_many_shoppers_evenly() -> None:
    eps, policy = replicas(8), SessionAffinityPolicy()
    counts = Counter(policy.choose(request(f"shopper-{i}"), eps).name for i in range(8000))
    assert max(counts.values()) < 1.15 * 1000 and min(counts.values()) > 0.85 * 1000
