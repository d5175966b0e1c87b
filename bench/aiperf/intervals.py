"""How far one run's percentiles can be trusted: a bootstrap interval over its requests.

aiperf reports each percentile once. One run of a few hundred requests on a shared machine gives a p99
that is the third-highest request, so two policies' p99s can differ by chance alone. The interval here
resamples the run's own requests (aiperf's per-request export) with replacement and takes the 2.5th and
97.5th percentiles of the statistic; where two cells' intervals overlap, the docs call it a tie. Requests
of one run share the machine's moments and the replicas' queues, so they are not independent and the
interval is, if anything, too narrow: it can show a tie, never prove a win on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DRAWS = 2000
CONFIDENCE = 0.95


def percentile(values: Sequence[float], q: float) -> float:
    """``q`` (0-100) as aiperf computes it: numpy's linear interpolation."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def bootstrap_interval(values: Sequence[float], q: float, seed: int = 0) -> tuple[float, float]:
    """The ``CONFIDENCE`` bootstrap interval of the ``q`` percentile of ``values``; deterministic for a
    seed."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    samples = rng.choice(data, size=(DRAWS, data.size), replace=True)
    stats = np.percentile(samples, q, axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)
