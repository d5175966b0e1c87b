"""How many prompts the admission gate lets reach the fleet at once: as many as the replicas serve
without queueing them, found from the time to first token the replicas answer with.

A fixed limit is wrong one way or the other. A replica's running batch (``max_batch_size``, 64) is far
more than it can hold in KV memory under TensorRT-LLM's GUARANTEED_NO_EVICT, so at 64 per replica the
surplus queues at the replica, where priority cannot reorder it, a newer prompt can only cancel it, and
a crash re-pays it (``bench.overload``: about 7.5 s at the replicas at 1x). A limit sized to the KV
memory (16 per replica) starves the batch and cut the fleet's answers per second by almost half in the
same benchmark. What the fleet can take depends on prompt lengths, cache hits and the model.

So the limit is found as TCP finds a window, additive increase and multiplicative decrease, with the
queueing delay as the congestion signal (as TCP Vegas, and Netflix's concurrency-limits, do with
latency). A prompt admitted to a replica that runs it at once gets its first token after its prefill,
under a second for our 2-4k-token prompts on an H100 (``../shared/calibration``); one that waits at the
replica for KV memory or a batch slot gets it seconds later. While answers come back within
``queue_ttft_ms`` and prompts wait at the gate, the limit grows by one per answer; an answer later than
that cuts it by ``backoff``, at most once per ``cut_interval_s``, since answers admitted before the cut
still carry the old queue. The limit stays between ``floor`` and ``ceiling`` (replicas x 1 and
replicas x ``per_replica_in_flight``), both read each time, and is scaled with the replicas when they
change, so it follows capacity shifting and a gateway's fleet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel, Field


class AdaptiveLimitSettings(BaseModel):
    enabled: bool = Field(
        True, description="adapt the admission limit to the replicas' queueing (off: always the ceiling)"
    )
    queue_ttft_ms: float = Field(
        2000.0,
        gt=0,
        description="a time to first token above this means the prompt queued at the replica: the limit "
        "is cut (a 4k-token prefill of a 32B model on an H100 takes about 500 ms)",
    )
    backoff: float = Field(0.75, gt=0, lt=1, description="the limit is multiplied by this at a cut")
    cut_interval_s: float = Field(
        2.0, gt=0, description="at most one cut per interval: answers admitted before a cut still queued"
    )
    start_per_replica: int = Field(16, ge=1, description="the limit per replica before any answer came back")
    token_ms: float | None = Field(
        60.0,
        gt=0,
        description="a time per output token (first to last token) above this means the replicas' "
        "iterations are crowded (a saturated replica spends them on others' prefills): the limit is cut "
        "too (what 60 and 40 measured: docs/overload.md); None: the time to first token only",
    )


class AdaptiveAdmissionLimit:
    """Callable as the gate's limit; ``observe`` each answer's time to first token."""

    def __init__(
        self,
        settings: AdaptiveLimitSettings,
        replicas: Callable[[], int],
        per_replica_ceiling: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._replicas = replicas
        self._per_replica_ceiling = per_replica_ceiling
        self._clock = clock
        self._for_replicas = max(1, replicas())
        """The replicas ``_value`` was found for: rescaled when they change (``_rescaled``)."""
        self._value = float(settings.start_per_replica * self._for_replicas)
        self._last_cut = float("-inf")
        self.cuts = 0
        """Times the limit was cut (the fleet queued)."""

    @property
    def floor(self) -> int:
        return max(1, self._replicas())

    @property
    def ceiling(self) -> int:
        return self.floor * self._per_replica_ceiling

    def __call__(self) -> int:
        if not self.settings.enabled:
            return self.ceiling
        return int(self._rescaled())

    def _rescaled(self) -> float:
        """The limit, clamped, after scaling it by the replicas' change since it was last found: a
        gateway names its fleet only in its first answer, and capacity shifting moves replicas. Held
        as a total, the limit started at 16 for the 17 replicas behind a gateway, then 17 (the floor)."""
        replicas = max(1, self._replicas())
        if replicas != self._for_replicas:
            self._value = self._value * replicas / self._for_replicas
            self._for_replicas = replicas
        self._value = min(max(self._value, self.floor), self.ceiling)
        return self._value

    def observe(self, ttft_ms: float, *, demand: bool, token_ms: float | None = None) -> None:
        """One answer came back after ``ttft_ms`` to its first token, then ``token_ms`` per further
        token; ``demand``: prompts are waiting at the gate, so a larger limit would be used."""
        value = self._rescaled()
        slow_tokens = (
            self.settings.token_ms is not None and token_ms is not None and token_ms > self.settings.token_ms
        )
        if ttft_ms > self.settings.queue_ttft_ms or slow_tokens:
            now = self._clock()
            if now - self._last_cut >= self.settings.cut_interval_s:
                value *= self.settings.backoff
                self._last_cut = now
                self.cuts += 1
        elif demand:
            value += 1.0
        self._value = min(max(value, self.floor), self.ceiling)
