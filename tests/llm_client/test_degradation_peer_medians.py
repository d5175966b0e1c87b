"""The degradation detector reads each replica's peer medians from one sorted pass over the pool
(``llm_client.degradation``): the same decisions as a median over each replica's own list of peers,
checked against that reference on random pools, and ``_median_without`` against ``statistics.median``."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_client.degradation import DegradationDetector, DegradationSettings, _median_without
from llm_client.endpoints import Endpoint

values = st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=40)


@given(values=values, data=st.data())
def test_a_median_without_one_value_is_the_median_of_the_rest(
    values: list[float], data: st.DataObject
) -> None:
    ordered = sorted(values)
    assert _median_without(ordered, None) == statistics.median(values)
    if len(values) > 1:
        index = data.draw(st.integers(0, len(values) - 1))
        rest = values[:index] + values[index + 1 :]
        assert _median_without(ordered, values[index]) == statistics.median(rest)


def reference_drift(detector: DegradationDetector, endpoint: Endpoint, pool: list[Endpoint]) -> str | None:
    """What a replica's judgement was before: its peers listed one by one, ``statistics.median``."""
    cfg = detector.settings
    judged = [e for e in pool if detector.signals(e).samples >= cfg.min_samples]
    if endpoint not in judged:
        return None
    peers = [detector.signals(e) for e in judged if e is not endpoint and e.healthy and not e.quarantined]
    if len(peers) < cfg.min_peers:
        return None
    mine = detector.signals(endpoint)
    latencies = [p.latency_per_work for p in peers if p.latency_per_work is not None]
    if mine.latency_per_work is not None and len(latencies) >= cfg.min_peers:
        median = statistics.median(latencies)
        if median > 0 and mine.latency_per_work > cfg.latency_factor * median:
            return "latency"
    median_errors = statistics.median(p.errors for p in peers)
    if mine.errors > cfg.error_threshold and mine.errors > cfg.error_factor * median_errors:
        return "errors"
    return None


replica = st.tuples(
    st.booleans(),  # healthy
    st.booleans(),  # quarantined
    st.integers(0, 30),  # samples
    st.one_of(st.none(), st.floats(min_value=0.1, max_value=100)),  # latency per work
    st.floats(min_value=0, max_value=1),  # error EWMA
)


@settings(max_examples=300)
@given(replicas=st.lists(replica, min_size=1, max_size=16))
def test_drains_are_those_of_each_replicas_own_peer_list(
    replicas: list[tuple[bool, bool, int, float | None, float]],
) -> None:
    """The first drain of an evaluation is the first replica, in pool order, whose own peer list says it
    drifted (later ones are judged against a pool without it; the drained share is no bound here, and
    ``min_routable`` 1 refuses a drain only where one replica is left in rotation)."""
    detector = DegradationDetector(
        DegradationSettings(min_samples=10, min_routable=1, max_drained_fraction=1.0), clock=lambda: 0.0
    )
    pool = []
    for i, (healthy, quarantined, samples, latency, errors) in enumerate(replicas):
        endpoint = Endpoint(url=f"http://r{i}", name=f"r{i}", healthy=healthy, quarantined=quarantined)
        signals = detector.signals(endpoint)
        signals.samples, signals.latency_per_work, signals.errors = samples, latency, errors
        pool.append(endpoint)
    expected = next(
        (e.name for e in pool if e.healthy and reference_drift(detector, e, pool) is not None), None
    )
    routable = sum(e.healthy and not e.quarantined for e in pool)
    changes = detector.evaluate(pool)
    first = changes[0].endpoint if changes else None
    if expected is not None and routable - 1 < 1:
        expected = None  # refused by min_routable, alike before and now
    assert first == expected
