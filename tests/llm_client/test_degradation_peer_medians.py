"""The degradation detector reads each replica's peer medians from one sorted pass over the pool
(``llm_client.degradation``): the same decisions as the code before it, a median over each replica's
own list of peers, checked against that reference on random pools; and ``_median_without`` against
``statistics.median``."""

from __future__ import annotations

import statistics

from hypothesis import example, given, settings
from hypothesis import strategies as st

from llm_client.degradation import DegradationDetector, DegradationSettings, HealthChange, _median_without
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


def reference_drift(
    detector: DegradationDetector, endpoint: Endpoint, pool: list[Endpoint], drained: set[str]
) -> str | None:
    """A replica's judgement as it was made before (d427e4b): its peers listed one by one,
    ``statistics.median`` of them."""
    cfg = detector.settings

    def judged(e: Endpoint) -> bool:
        return detector.signals(e).samples >= cfg.min_samples

    def in_rotation(e: Endpoint) -> bool:
        return e.healthy and not e.quarantined and e.name not in drained

    if not judged(endpoint):
        return None
    peers = [detector.signals(e) for e in pool if e is not endpoint and in_rotation(e) and judged(e)]
    if len(peers) < cfg.min_peers:
        return None
    mine = detector.signals(endpoint)
    latencies = [p.latency_per_work for p in peers if p.latency_per_work is not None]
    if mine.latency_per_work is not None and len(latencies) >= cfg.min_peers:
        median = statistics.median(latencies)
        if median > 0 and mine.latency_per_work > cfg.latency_factor * median:
            return (
                f"latency {mine.latency_per_work:.2f} ms/token is {mine.latency_per_work / median:.1f}x "
                f"the peer median {median:.2f}"
            )
    median_errors = statistics.median(p.errors for p in peers)
    if mine.errors > cfg.error_threshold and mine.errors > cfg.error_factor * median_errors:
        return f"error rate {mine.errors:.2f} vs peer median {median_errors:.2f}"
    return None


def reference_evaluate(detector: DegradationDetector, pool: list[Endpoint]) -> list[HealthChange]:
    """``evaluate`` as it was before, around ``reference_drift``."""
    now = detector.clock()
    changes = [detector._readmit(e, now) for e in pool if e.drained and detector._cooled_down(e, now)]
    drained = {e.name for e in pool if e.drained} - {c.endpoint for c in changes}
    for endpoint in pool:
        if endpoint.healthy and endpoint.name not in drained:
            reason = reference_drift(detector, endpoint, pool, drained)
            if reason is not None and detector._may_drain(pool, drained):
                changes.append(detector._drain(endpoint, now, reason))
                drained.add(endpoint.name)
    return changes


replica = st.tuples(
    st.booleans(),  # healthy
    st.booleans(),  # quarantined
    st.booleans(),  # drained (since drained_at, below)
    st.floats(min_value=0, max_value=100),  # drained_at: cooled down once 30 s have passed
    st.integers(0, 30),  # samples
    st.one_of(st.none(), st.sampled_from([1.0, 2.0]), st.floats(min_value=0.1, max_value=100)),
    st.one_of(st.sampled_from([0.0, 0.5]), st.floats(min_value=0, max_value=1)),  # error EWMA
)


def pool_of(
    replicas: list[tuple[bool, bool, bool, float, int, float | None, float]], settings: DegradationSettings
) -> tuple[DegradationDetector, list[Endpoint]]:
    detector = DegradationDetector(settings, clock=lambda: 100.0)
    pool = []
    for i, (healthy, quarantined, drained, drained_at, samples, latency, errors) in enumerate(replicas):
        endpoint = Endpoint(
            f"http://r{i}", f"r{i}", healthy=healthy, quarantined=quarantined, drained=drained
        )
        s = detector.signals(endpoint)
        s.samples, s.latency_per_work, s.errors = samples, latency, errors
        if drained:
            s.drained_at, s.cooldown_s = drained_at, 30.0
        pool.append(endpoint)
    return detector, pool


SLOW_THREE = [(True, False, False, 0.0, 30, latency, 0.0) for latency in (10.0, 10.0, 3.5, 1.0, 1.0)]
"""Three drains in one evaluation, the third only against a pool without the first two (3.5 is over
3x the median of 1 and 1, under 3x that of 1, 1, 10 and 10)."""


@settings(max_examples=400)
@example(replicas=SLOW_THREE, min_peers=1, min_routable=1, max_drained_fraction=1.0)
@given(
    replicas=st.lists(replica, min_size=1, max_size=16),
    min_peers=st.integers(1, 3),
    min_routable=st.integers(1, 3),
    max_drained_fraction=st.sampled_from([0.25, 0.5, 1.0]),
)
def test_every_decision_is_that_of_each_replicas_own_peer_list(
    replicas: list[tuple[bool, bool, bool, float, int, float | None, float]],
    min_peers: int,
    min_routable: int,
    max_drained_fraction: float,
) -> None:
    """The whole evaluation (re-admissions, then each drain in pool order, later ones judged without
    the replicas drained before them), on pools with drained, cooled-down, quarantined, ejected and
    unjudged replicas, tied values and no latency yet: the same changes, reasons included."""
    settings = DegradationSettings(
        min_samples=10,
        min_peers=min_peers,
        min_routable=min_routable,
        max_drained_fraction=max_drained_fraction,
    )
    detector, pool = pool_of(replicas, settings)
    reference, reference_pool = pool_of(replicas, settings)
    assert detector.evaluate(pool) == reference_evaluate(reference, reference_pool)
