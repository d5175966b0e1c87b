"""The adaptive admission limit (pipeline.admission_limit): grows while answers come back unqueued and
prompts wait, is cut when the replicas queue, and stays between one and max_batch_size per replica."""

from __future__ import annotations

from pipeline.admission_limit import AdaptiveAdmissionLimit, AdaptiveLimitSettings

FAST, QUEUED = 600.0, 5000.0  # ms to first token: a prefill, and a prompt that waited at the replica


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def limit_for(replicas: list[int], clock: Clock, **settings: object) -> AdaptiveAdmissionLimit:
    return AdaptiveAdmissionLimit(
        AdaptiveLimitSettings.model_validate(settings), lambda: replicas[0], 64, clock=clock
    )


def test_grows_by_one_per_unqueued_answer_only_while_prompts_wait() -> None:
    limit = limit_for([3], Clock())
    assert limit() == 3 * 16
    limit.observe(FAST, demand=False)
    assert limit() == 48
    for _ in range(10):
        limit.observe(FAST, demand=True)
    assert limit() == 58


def test_a_queued_answer_cuts_once_per_interval() -> None:
    clock = Clock()
    limit = limit_for([3], clock)
    limit.observe(QUEUED, demand=True)
    assert limit() == 36  # 48 x 0.75
    limit.observe(QUEUED, demand=True)  # admitted before the cut: no second cut yet
    assert limit() == 36 and limit.cuts == 1
    clock.now += 2.0
    limit.observe(QUEUED, demand=True)
    assert limit() == 27 and limit.cuts == 2


def test_stays_between_one_and_the_batch_per_replica_and_follows_the_fleet() -> None:
    clock, replicas = Clock(), [2]
    limit = limit_for(replicas, clock)
    for _ in range(40):
        clock.now += 2.0
        limit.observe(QUEUED, demand=True)
    assert limit() == 2  # one per replica
    for _ in range(500):
        limit.observe(FAST, demand=True)
    assert limit() == 128  # max_batch_size per replica
    replicas[0] = 1  # a replica moved to another pool
    assert limit() == 64


def test_disabled_is_the_ceiling() -> None:
    limit = limit_for([3], Clock(), enabled=False)
    limit.observe(QUEUED, demand=True)
    assert limit() == 192


def test_slow_tokens_cut_the_limit() -> None:
    """A replica crowded with others' prefills answers its first token fast and the rest slowly: that
    is a cut too (``token_ms``, 60 ms by default); with it unset, only the first token counts."""
    clock = Clock()
    unset, capped = limit_for([3], clock, token_ms=None), limit_for([3], clock)
    for limit in (unset, capped):
        limit.observe(FAST, demand=True, token_ms=70.0)
    assert (unset(), capped()) == (49, 36)
    capped.observe(FAST, demand=True, token_ms=50.0)
    assert capped() == 37
