"""Goodput by search: the highest offered rate that meets an SLO, found by bisection, with repeats.

A ladder of rates (4, 8, 16, 24, 32) decides goodput to a factor of 2 at its low end, from one run per
rung. Here each repeat (its own arrival seed) brackets the rate where the SLO starts to fail and halves
the bracket (geometrically) until its ends are within ``tolerance`` of each other (5%: the highest
passing rate is within 5% of the lowest failing one). Several SLOs are searched over the same probes:
a probe measures everything once, and every search that asks for the same (rate, repeat) reuses it.

The result per SLO is each repeat's bracket; its estimate is the median of the repeats' highest passing
rates, and its interval runs from the lowest passing rate of any repeat to the highest failing one, so
it holds both the search's resolution and the spread between repeats. One goodput beats another only
where those intervals do not overlap (``separates``); otherwise the two are a tie.

The search assumes that meeting the SLO is monotone in the rate. A noisy probe can break that (a pass
above a fail); the bracket then still holds one pass and one fail within ``tolerance``, which is what is
reported, and the spread between repeats shows the noise.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

M = TypeVar("M")


@dataclass(frozen=True)
class Bracket:
    """One repeat's search: ``passed`` the highest rate that met the SLO (0: none down to the floor),
    ``failed`` the lowest that missed it (None: none up to the ceiling)."""

    repeat: int
    passed: float
    failed: float | None


@dataclass(frozen=True)
class Goodput:
    """One SLO's searched goodput: every repeat's bracket."""

    brackets: tuple[Bracket, ...]

    @property
    def estimate(self) -> float:
        """Median over repeats of the highest rate that met the SLO."""
        return statistics.median(b.passed for b in self.brackets)

    @property
    def interval(self) -> tuple[float, float]:
        """From the lowest passing rate of any repeat to the highest failing rate (inf: one never failed)."""
        high = [b.failed for b in self.brackets]
        top = math.inf if any(f is None for f in high) else max(f for f in high if f is not None)
        return min(b.passed for b in self.brackets), top


def separates(a: Goodput, b: Goodput) -> int:
    """1 where ``a`` beats ``b`` (a's interval wholly above b's), -1 where ``b`` beats ``a``, 0: a tie."""
    (a_lo, a_hi), (b_lo, b_hi) = a.interval, b.interval
    if a_lo >= b_hi:
        return 1
    if b_lo >= a_hi:
        return -1
    return 0


@dataclass
class SearchPlan:
    """Where to look: the first bracket ``[low, high]``, how far out to widen it, when to stop."""

    low: float
    high: float
    floor: float
    ceiling: float
    tolerance: float = 0.05
    repeats: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.low < self.high <= self.ceiling:
            raise ValueError(f"need 0 < floor <= low < high <= ceiling, got {self}")
        if self.tolerance <= 0 or self.repeats < 1:
            raise ValueError("tolerance must be > 0 and repeats >= 1")


@dataclass
class GoodputSearch(Generic[M]):
    """Searches several SLOs (``meets``, by name) over one measurement function, sharing its probes.

    ``measure(rate, repeat)`` runs one probe and returns what it measured; ``meets[name](measured)`` says
    whether that probe meets SLO ``name``. ``probes`` keeps every probe, by (rate, repeat), in the order
    they ran."""

    measure: Callable[[float, int], Awaitable[M]]
    meets: Mapping[str, Callable[[M], bool]]
    plan: SearchPlan
    probes: dict[tuple[float, int], M] = field(default_factory=dict)

    async def _probe(self, rate: float, repeat: int) -> M:
        key = (round(rate, 6), repeat)
        if key not in self.probes:
            self.probes[key] = await self.measure(key[0], repeat)
        return self.probes[key]

    async def _bracket(self, meets: Callable[[M], bool], repeat: int) -> Bracket:
        plan = self.plan
        passed: float = 0.0
        failed: float | None = None
        rate = plan.low
        while True:  # widen downwards until a pass, or the floor fails
            if meets(await self._probe(rate, repeat)):
                passed = rate
                break
            failed = rate
            if rate <= plan.floor:
                return Bracket(repeat, 0.0, failed)
            rate = max(plan.floor, rate / 2)
        if failed is None:
            rate = plan.high
            while True:  # widen upwards until a fail, or the ceiling passes
                if not meets(await self._probe(rate, repeat)):
                    failed = rate
                    break
                passed = rate
                if rate >= plan.ceiling:
                    return Bracket(repeat, passed, None)
                rate = min(plan.ceiling, rate * 2)
        while failed / passed > 1 + plan.tolerance:
            middle = math.sqrt(passed * failed)
            if meets(await self._probe(middle, repeat)):
                passed = middle
            else:
                failed = middle
        return Bracket(repeat, passed, failed)

    async def run(self) -> dict[str, Goodput]:
        """Every SLO's goodput; repeats run one after the other, SLOs in the order given."""
        brackets: dict[str, list[Bracket]] = {name: [] for name in self.meets}
        for repeat in range(self.plan.repeats):
            for name, meets in self.meets.items():
                brackets[name].append(await self._bracket(meets, repeat))
        return {name: Goodput(tuple(found)) for name, found in brackets.items()}


def goodput_cell(goodput: Goodput, scale: float = 1.0, digits: int = 2) -> str:
    """``estimate [low, high]`` divided by ``scale`` (e.g. per GPU), for a table."""
    lo, hi = goodput.interval
    top = "∞" if math.isinf(hi) else f"{hi / scale:.{digits}f}"
    return f"{goodput.estimate / scale:.{digits}f} [{lo / scale:.{digits}f}, {top}]"


def brackets_from_json(rows: Sequence[Mapping[str, object]]) -> Goodput:
    """A ``Goodput`` back from its brackets as stored in a results file (``dataclasses.asdict``)."""
    found = []
    for row in rows:
        failed = row["failed"]
        upper = None if failed is None else float(str(failed))
        found.append(Bracket(int(str(row["repeat"])), float(str(row["passed"])), upper))
    return Goodput(tuple(found))


def add_search_arguments(parser: argparse.ArgumentParser, *, bracket_help: str, repeats_help: str) -> None:
    """``--search LOW HIGH``, ``--repeats`` and ``--tolerance``: the search's options as every benchmark
    that reports goodput takes them (3 repeats, 5%)."""
    parser.add_argument("--search", type=float, nargs=2, metavar=("LOW", "HIGH"), help=bracket_help)
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="stop when the bracket's ends are this close"
    )
