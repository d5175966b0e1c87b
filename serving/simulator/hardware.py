"""What one GPU holds and how fast it runs: model shapes, GPU kinds and the KV cache they leave room for.

TensorRT-LLM sizes its KV cache from memory, not from a setting: after loading the weights and running a
profiling forward pass of ``max_num_tokens`` tokens, it gives ``free_gpu_memory_fraction`` (0.9 by
default) of the memory still free to KV blocks of ``tokens_per_block`` (32) tokens. ``kv_cache_blocks``
does the same sum from the model's shape, the weights' data type and the GPU kind, so a simulated replica
holds what the card it stands for holds: Qwen2.5-32B in bf16 on an 80 GB H100 has room for about 1,800
blocks (59k tokens), not the 8,192 the simulator once assumed.

The figures are public specifications (model ``config.json`` files, NVIDIA's H100 and H200 datasheets);
the activation estimate is ours and is stated in ``activation_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GpuKind = Literal["h100-80gb", "h200-141gb"]
WeightDtype = Literal["bf16", "fp8"]
KvCacheDtype = Literal["auto", "bf16", "fp8"]

_MIB = 1024 * 1024
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator kind, from its datasheet (SXM parts, dense tensor-core peaks without sparsity)."""

    name: str
    memory_bytes: int
    """What the driver reports as the card's memory (``nvidia-smi``'s total), before any allocation."""
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float

    def peak_flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


GPUS: dict[GpuKind, GpuSpec] = {
    # H100 SXM5 80GB: 81,559 MiB reported, HBM3 3.35 TB/s, 989 dense bf16 / 1,979 dense FP8 TFLOP/s.
    "h100-80gb": GpuSpec("H100 SXM 80GB", 81_559 * _MIB, 3.35e12, 989.4e12, 1978.9e12),
    # H200 SXM 141GB: 143,771 MiB reported, HBM3e 4.8 TB/s, the same tensor cores as the H100.
    "h200-141gb": GpuSpec("H200 SXM 141GB", 143_771 * _MIB, 4.8e12, 989.4e12, 1978.9e12),
}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape, from its Hugging Face ``config.json``."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position_embeddings: int

    @property
    def embedding_params(self) -> int:
        """Input embedding and output head (untied in both models here)."""
        return 2 * self.vocab * self.hidden

    @property
    def linear_params(self) -> int:
        """Weights every token multiplies through (the layers, not the embedding lookup or the head)."""
        return self.params - self.embedding_params

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V, every layer, every KV head: 262,144 bytes a token for Qwen2.5-32B in bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def weight_bytes(self, weight_dtype: str) -> int:
        """Weights in memory. FP8 checkpoints (ModelOpt) keep the embedding and head in bf16."""
        if weight_dtype == "fp8":
            return self.linear_params * 1 + self.embedding_params * 2
        return self.params * DTYPE_BYTES[weight_dtype]


MODELS: dict[str, ModelSpec] = {
    # Qwen/Qwen2.5-32B-Instruct config.json: 64 layers, 5120 hidden, 40 heads, 8 KV heads, 27648 MLP.
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", 32_763_876_352, 64, 5120, 40, 8, 128, 27648, 152_064, 32768),
    # meta-llama/Llama-3.1-8B-Instruct config.json: 32 layers, 4096 hidden, 32 heads, 8 KV heads, 14336 MLP.
    "llama3-8b": ModelSpec("Llama-3.1-8B", 8_030_261_248, 32, 4096, 32, 8, 128, 14336, 128_256, 131072),
}

RUNTIME_RESERVED_BYTES = 1024 * _MIB
"""CUDA context, cuBLAS and attention workspaces, CUDA graph pools: what a started engine holds besides
weights and activations (about 1 GiB on an H100 in TensorRT-LLM's PyTorch backend logs)."""


def resolved_kv_dtype(kv_cache_dtype: KvCacheDtype, weight_dtype: WeightDtype) -> str:
    """``auto`` follows the checkpoint, as TensorRT-LLM's ``kv_cache_config.dtype`` does: NVIDIA's FP8
    ModelOpt checkpoints also quantise the KV cache to FP8, a bf16 checkpoint keeps it in bf16."""
    return weight_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def activation_bytes(model: ModelSpec, max_num_tokens: int) -> int:
    """Peak activations of the profiling pass TensorRT-LLM runs before sizing the cache: one forward of
    ``max_num_tokens`` tokens, whose largest live tensors are the MLP's fused gate/up output and its
    activation (3 x intermediate) beside a few hidden-sized buffers (4 x hidden), in bf16. Plus the
    runtime's own reservations (``RUNTIME_RESERVED_BYTES``)."""
    per_token = (3 * model.intermediate + 4 * model.hidden) * 2
    return RUNTIME_RESERVED_BYTES + max_num_tokens * per_token


@dataclass(frozen=True)
class KvMemory:
    """How a replica's KV cache was sized; printed on start so a reader can check the sum."""

    gpu: str
    model: str
    weight_dtype: str
    kv_dtype: str
    gpu_memory_bytes: int
    weight_bytes: int
    activation_bytes: int
    free_gpu_memory_fraction: float
    kv_bytes_per_token: int
    tokens_per_block: int
    blocks: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.tokens_per_block


def kv_memory(
    model_key: str,
    gpu: GpuKind,
    weight_dtype: WeightDtype,
    kv_cache_dtype: KvCacheDtype,
    *,
    free_gpu_memory_fraction: float,
    tokens_per_block: int,
    max_num_tokens: int,
) -> KvMemory:
    """blocks = fraction x (GPU memory - weights - activations) / (KV bytes per token x tokens per block).

    At least one block, so a model that does not fit still starts (and queues everything)."""
    model = MODELS[model_key]
    spec = GPUS[gpu]
    kv_dtype = resolved_kv_dtype(kv_cache_dtype, weight_dtype)
    weights = model.weight_bytes(weight_dtype)
    activations = activation_bytes(model, max_num_tokens)
    free = max(spec.memory_bytes - weights - activations, 0)
    per_token = model.kv_bytes_per_token(kv_dtype)
    blocks = int(free_gpu_memory_fraction * free) // (per_token * tokens_per_block)
    return KvMemory(
        gpu=spec.name,
        model=model.name,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        gpu_memory_bytes=spec.memory_bytes,
        weight_bytes=weights,
        activation_bytes=activations,
        free_gpu_memory_fraction=free_gpu_memory_fraction,
        kv_bytes_per_token=per_token,
        tokens_per_block=tokens_per_block,
        blocks=max(blocks, 1),
    )
