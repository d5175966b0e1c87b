"""``bench.goodput_search``: the bisection finds the threshold to its tolerance, shares probes between
SLOs, widens its first bracket when the threshold lies outside it, and calls a tie where intervals overlap.

The measurement here is a pure function of the rate (the search is pure logic; the benchmarks that use it
run real replicas), so the threshold it must find is known exactly."""

from __future__ import annotations

import asyncio

import pytest

from bench.goodput_search import Bracket, Goodput, GoodputSearch, SearchPlan, separates

PLAN = SearchPlan(low=8.0, high=24.0, floor=1.0, ceiling=96.0, tolerance=0.05, repeats=3)


def search(thresholds: dict[str, float], plan: SearchPlan = PLAN) -> tuple[dict[str, Goodput], list[float]]:
    """Search SLOs that pass exactly below each threshold (per repeat: the threshold + the repeat)."""
    calls: list[float] = []

    async def measure(rate: float, repeat: int) -> tuple[float, int]:
        calls.append(rate)
        return rate, repeat

    meets = {name: (lambda m, t=t: m[0] <= t + m[1]) for name, t in thresholds.items()}
    return asyncio.run(GoodputSearch(measure, meets, plan).run()), calls


@pytest.mark.parametrize("threshold", [3.3, 10.0, 17.5, 40.0])
def test_each_repeat_brackets_its_threshold_within_the_tolerance(threshold: float) -> None:
    found, _ = search({"slo": threshold})
    for bracket in found["slo"].brackets:
        truth = threshold + bracket.repeat
        assert bracket.failed is not None
        assert bracket.passed <= truth < bracket.failed
        assert bracket.failed / bracket.passed <= 1 + PLAN.tolerance
    lo, hi = found["slo"].interval
    assert lo <= threshold and hi > threshold + PLAN.repeats - 1


def test_slos_with_the_same_threshold_share_every_probe() -> None:
    one, calls_one = search({"a": 13.0})
    two, calls_two = search({"a": 13.0, "b": 13.0})
    assert len(calls_two) == len(calls_one)
    assert two["a"] == two["b"] == one["a"]


def test_a_threshold_below_the_floor_is_zero_and_above_the_ceiling_unbounded() -> None:
    found, _ = search({"never": -5.0, "always": 1000.0})
    assert found["never"].estimate == 0.0
    assert found["always"].interval[1] == float("inf")


def test_overlapping_intervals_are_a_tie_and_separate_ones_a_win() -> None:
    low = Goodput((Bracket(0, 10.0, 10.4), Bracket(1, 11.0, 11.5)))
    high = Goodput((Bracket(0, 11.2, 11.7), Bracket(1, 12.0, 12.5)))
    far = Goodput((Bracket(0, 20.0, 21.0), Bracket(1, 20.5, 21.0)))
    assert separates(low, high) == 0
    assert separates(far, low) == 1 and separates(low, far) == -1
