"""The default iteration cost: one fused forward pass on an H100 roofline, calibrated to TensorRT-LLM.

TensorRT-LLM runs an iteration's context (prefill) tokens and generation (decode) tokens in **one**
forward pass, so an iteration costs what its tokens and the bytes they read cost together, not a prefill
plus a decode step. The pass is bound either by the tensor cores or by HBM:

- the GEMMs: ``2 x linear params`` FLOPs per token and ``2 x vocab x hidden`` per sequence (the logits
  of its last token) at the weights' dense peak (bf16 989 TFLOP/s, FP8 1,979 TFLOP/s on an H100 SXM)
  times ``mfu``, or every weight read once at the HBM bandwidth (3.35 TB/s) times ``mbu``, whichever is
  longer;
- then attention, a separate kernel: ``4 x layers x heads x head_dim`` FLOPs per (query, key) pair at the
  bf16 peak times ``mfu``, or the KV of every context attended to (decode contexts, cached prefixes) and
  the new tokens' KV at the HBM rate, whichever is longer;
- plus ``overhead_ms`` per iteration (scheduling, sampling, launches that CUDA graphs do not hide).

Adding the two kernels' times rather than taking one maximum matters for mixed iterations: the GEMMs of
a prefill are compute-bound while decode attention is memory-bound, and they do not overlap.

``mfu``, ``mbu`` and ``overhead_ms`` are fitted once, by ``bench/fidelity.py``, to the offline throughput
TensorRT-LLM publishes for Llama-3.1-8B FP8 on one H100 (docs/simulator.md, "Fidelity to TensorRT-LLM"),
and used unchanged for every model, data type and GPU kind; the fit and its error per figure are in that
table. The eager-PyTorch table (``cost_model.CostModel``) stays available as ``--cost-model
eager_pytorch``.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.simulator.cost_model import IterationWork, MixedBatchCost
from serving.simulator.hardware import DTYPE_BYTES, GPUS, MODELS, GpuKind, GpuSpec, ModelSpec

MFU = 0.50
"""Share of the dense tensor-core peak the GEMMs and attention reach when compute-bound (fitted)."""
MBU = 0.90
"""Share of HBM bandwidth reached when memory-bound (fitted; CUDA-graph decode in TensorRT-LLM)."""
OVERHEAD_MS = 1.5
"""Fixed host and launch cost of one iteration, ms (fitted)."""


@dataclass(frozen=True)
class RooflineCost:
    """Pure timing of one iteration on one GPU; ``iteration_ms`` is milliseconds of GPU time."""

    model: ModelSpec
    gpu: GpuSpec
    weight_dtype: str
    kv_dtype: str
    mfu: float = MFU
    mbu: float = MBU
    overhead_ms: float = OVERHEAD_MS

    @classmethod
    def for_hardware(
        cls,
        model_key: str,
        gpu: GpuKind,
        weight_dtype: str,
        kv_dtype: str,
        *,
        mfu: float = MFU,
        mbu: float = MBU,
        overhead_ms: float = OVERHEAD_MS,
    ) -> RooflineCost:
        return cls(MODELS[model_key], GPUS[gpu], weight_dtype, kv_dtype, mfu, mbu, overhead_ms)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype)

    def iteration_ms(self, work: IterationWork, mixed: MixedBatchCost = "fused") -> float:
        """GPU time of one fused pass over ``work`` (``mixed`` is ignored: a pass is always fused)."""
        del mixed
        m = self.model
        new_tokens = sum(n for n, _ in work.prefills)
        tokens = new_tokens + work.decode_batch
        if tokens <= 0:
            return 0.0
        sequences = len(work.prefills) + work.decode_batch
        hbm = self.gpu.hbm_bytes_per_s * self.mbu
        # The layers' GEMMs: every token through the weights, read once.
        gemm_flops = 2.0 * m.linear_params * tokens + 2.0 * m.vocab * m.hidden * sequences
        weights = m.linear_params * DTYPE_BYTES[self.weight_dtype] + m.vocab * m.hidden * 2
        gemm_s = max(gemm_flops / (self.gpu.peak_flops(self.weight_dtype) * self.mfu), weights / hbm)
        # Attention: every (query, key) pair, the KV of every context attended to, the new tokens' KV.
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in work.prefills) + work.decode_context
        attention_flops = 4.0 * m.layers * m.heads * m.head_dim * pairs
        context_read = work.decode_context + sum(c for _, c in work.prefills)
        kv_bytes = (context_read + tokens) * self.kv_bytes_per_token
        attention_s = max(attention_flops / (self.gpu.bf16_flops * self.mfu), kv_bytes / hbm)
        return (gemm_s + attention_s) * 1000.0 + self.overhead_ms

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt alone in a pass (for benchmarks that price a prefill)."""
        if new_tokens <= 0:
            return 0.0
        return self.iteration_ms(IterationWork(((new_tokens, cached_tokens),), 0, 0))

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """A pass that only decodes ``batch_size`` requests holding ``context_tokens`` in total."""
        if batch_size <= 0:
            return 0.0
        return self.iteration_ms(IterationWork((), batch_size, context_tokens))
