"""How long one engine iteration takes on the GPU, fitted to measured H100 timings.

The fit is deliberately a set of piecewise-linear curves through the measured points rather than a
parametric roofline: the measurements come from an eager PyTorch path whose small steps are dominated by
kernel-launch overhead (see the calibration file's notes), so no simple FLOP/byte model reproduces them,
while straight lines between measured points reproduce them exactly and stay monotone in between.

- Cold prefill of ``n`` tokens: ``cold(n)``, linear interpolation of the ``prefill_ms`` table, extended
  linearly beyond both ends with the slope of the first / last segment.
- Prefill of ``n`` new tokens on ``c`` cached ones: ``cold(n) + excess(c, n)``. The *excess* is what the
  ``suffix_on_cached_prefix_ms`` points cost beyond a cold prefill of the same suffix (attention over the
  cached prefix plus fixed overhead). For each measured prefix length the excess is interpolated over the
  suffix length (held constant outside the measured suffixes); across prefix lengths it is interpolated
  linearly from ``excess = 0`` at ``c = 0`` and held constant beyond the largest measured prefix, because
  the measured excess does not grow with the prefix (it is launch noise, not attention cost).
- Decode step of a batch of ``b`` requests: linear interpolation over ``b`` of the ``decode_step_ms_ctx*``
  table (linear extrapolation beyond it), plus the time to stream the KV cache that the batch's context
  holds beyond the table's reference context, at H100 HBM bandwidth. That context term is physics, not
  calibration: the tables were measured at one context length per model.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from prompt_assembly.errors import ConfigurationError

H100_HBM_BYTES_PER_S = 3.35e12

# KV bytes per token = 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16).
KV_BYTES_PER_TOKEN = {
    "qwen2.5-32b": 2 * 64 * 8 * 128 * 2,
    "llama3-8b": 2 * 32 * 8 * 128 * 2,
}

_DECODE_TABLE_KEY = re.compile(r"^decode_step_ms_ctx(\d+)$")

MixedBatchCost = Literal["additive", "fused"]
CostModelKind = Literal["roofline", "eager_pytorch"]


@dataclass(frozen=True)
class IterationWork:
    """What one engine iteration computes: each prompt (or chunk) it prefills as ``(new tokens, tokens
    already in the KV cache before them)``, and the decode batch with the context it attends to."""

    prefills: tuple[tuple[int, int], ...]
    decode_batch: int
    decode_context: int


class IterationCost(Protocol):
    """Anything that prices an iteration: ``roofline.RooflineCost`` (the default) or ``CostModel``."""

    def iteration_ms(self, work: IterationWork, mixed: MixedBatchCost = "fused") -> float: ...

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float: ...


def mixed_iteration_ms(prefill_ms: float, decode_ms: float, mode: MixedBatchCost = "additive") -> float:
    """GPU time of one iteration that prefills prompts (``prefill_ms``) and decodes a running batch
    (``decode_ms``) together; either part may be 0.

    ``additive`` (the default, and what the simulator always did): the two run one after the other. It is
    the only rule the calibration can vouch for: it has no mixed-batch measurement, and its
    ``batched_prefill_ms`` points show prompts in one step cost what they cost alone (a step's tokens add
    up linearly), so adding the decode step's tokens is the consistent extrapolation.

    ``fused``: one forward pass over the weights serves both, so the iteration costs the larger of the two.
    Each measured time already includes the per-step floor (kernel launches, the weight read), so taking
    the maximum pays that floor once instead of twice. On the eager PyTorch path the calibration measured,
    short steps are launch-bound (a 25-55 ms floor), so a real fused step is much closer to the maximum
    than to the sum; but a decode batch adds attention work a prefill does not have, so ``fused`` is a
    lower bound and ``additive`` an upper bound of a real mixed step.
    """
    if mode == "fused":
        return max(prefill_ms, decode_ms)
    return prefill_ms + decode_ms


def kv_cache_bytes(tokens: int, model_key: str) -> int:
    """Bytes of KV cache ``tokens`` tokens hold (bf16, the model's real layer and head shape)."""
    return tokens * KV_BYTES_PER_TOKEN.get(model_key, 0)


@dataclass(frozen=True)
class KvLink:
    """The path a prompt's KV cache takes from a context replica to a generation replica.

    ``transfer_ms(n) = latency_ms + n bytes / bandwidth``: a fixed cost per transfer (connection set-up
    and the transceiver's bookkeeping) plus the bytes at the link's rate. ``gbps`` is in gigabits per
    second, as NICs are sold.
    """

    latency_ms: float
    gbps: float

    def transfer_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes * 8 / (self.gbps * 1e9) * 1000.0


class CalibrationError(ConfigurationError):
    """The calibration file lacks the model or a table the cost model needs."""


@dataclass(frozen=True)
class PiecewiseLinear:
    """Straight lines through sorted points; ``extrapolate`` continues the end segments, else clamps."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    extrapolate: bool = True

    @classmethod
    def from_points(cls, points: dict[float, float], *, extrapolate: bool = True) -> PiecewiseLinear:
        if not points:
            raise CalibrationError("a curve needs at least one point")
        xs = tuple(sorted(points))
        return cls(xs, tuple(points[x] for x in xs), extrapolate)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        if x <= xs[0]:
            i = 0
            if not self.extrapolate:
                return ys[0]
        elif x >= xs[-1]:
            i = len(xs) - 2
            if not self.extrapolate:
                return ys[-1]
        else:
            i = bisect.bisect_right(xs, x) - 1
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    """Pure timing model of one replica; every method returns milliseconds of GPU time."""

    model_key: str
    cold_prefill: PiecewiseLinear
    # (cached prefix length, excess-over-cold curve in new tokens), sorted by prefix length.
    excess_by_prefix: tuple[tuple[int, PiecewiseLinear], ...]
    decode_by_batch: PiecewiseLinear
    decode_reference_context: int
    kv_ms_per_context_token: float

    @classmethod
    def from_calibration(cls, path: Path, model_key: str) -> CostModel:
        data = json.loads(Path(path).read_text())
        results = {r["model"]: r for r in data.get("results", [])}
        if model_key not in results:
            raise CalibrationError(f"{path} has no results for {model_key!r}; it has {sorted(results)}")
        r = results[model_key]
        cold = PiecewiseLinear.from_points({float(k): float(v) for k, v in r["prefill_ms"].items()})

        excess_points: dict[int, dict[float, float]] = defaultdict(dict)
        for key, ms in r.get("suffix_on_cached_prefix_ms", {}).items():
            prefix, suffix = (int(part) for part in key.split("+"))
            excess_points[prefix][float(suffix)] = float(ms) - cold(suffix)
        excess = tuple(
            (prefix, PiecewiseLinear.from_points(points, extrapolate=False))
            for prefix, points in sorted(excess_points.items())
        )

        decode_tables = [(int(m.group(1)), v) for k, v in r.items() if (m := _DECODE_TABLE_KEY.match(k))]
        if not decode_tables:
            raise CalibrationError(f"{path} has no decode_step_ms_ctx<N> table for {model_key!r}")
        reference_context, table = decode_tables[0]
        decode = PiecewiseLinear.from_points({float(k): float(v) for k, v in table.items()})
        kv_ms = KV_BYTES_PER_TOKEN.get(model_key, 0) / H100_HBM_BYTES_PER_S * 1000.0
        return cls(model_key, cold, excess, decode, reference_context, kv_ms)

    def iteration_ms(self, work: IterationWork, mixed: MixedBatchCost = "additive") -> float:
        """The eager table's price of an iteration: every prefill in it as one prompt of their summed new
        tokens on their summed cached ones, and the decode step, combined by ``mixed_iteration_ms``."""
        prefill = 0.0
        if work.prefills:
            new = sum(n for n, _ in work.prefills)
            prefill = self.prefill_ms(new, sum(c for _, c in work.prefills))
        decode = self.decode_step_ms(work.decode_batch, work.decode_context)
        return mixed_iteration_ms(prefill, decode, mixed)

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """GPU time to compute ``new_tokens`` prompt tokens whose first ``cached_tokens`` are reused."""
        if new_tokens <= 0:
            return 0.0
        ms = self.cold_prefill(new_tokens)
        if cached_tokens > 0:
            ms += self._excess(cached_tokens, new_tokens)
        return max(ms, 0.0)

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """GPU time for one decode step of ``batch_size`` requests holding ``context_tokens`` in total."""
        if batch_size <= 0:
            return 0.0
        base = self.decode_by_batch(batch_size)
        extra_context = context_tokens - batch_size * self.decode_reference_context
        # The floor keeps a batch of very short contexts from costing less than half a measured step.
        return max(base + extra_context * self.kv_ms_per_context_token, 0.5 * base)

    def _excess(self, cached_tokens: int, new_tokens: int) -> float:
        if not self.excess_by_prefix:
            return 0.0
        prefixes = [0] + [p for p, _ in self.excess_by_prefix]
        values = [0.0] + [curve(new_tokens) for _, curve in self.excess_by_prefix]
        across = PiecewiseLinear(tuple(map(float, prefixes)), tuple(values), extrapolate=False)
        return across(cached_tokens)
