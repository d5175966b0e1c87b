"""Configuration of one simulated replica, read from ``SIM_*`` environment variables and CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from serving.simulator.bad_answers import BadAnswer
from serving.simulator.cost_model import CostModelKind, MixedBatchCost
from serving.simulator.engine import CapacityPolicy, ChunkingPolicy
from serving.simulator.hardware import MODELS, GpuKind, KvCacheDtype, KvMemory, WeightDtype, kv_memory
from serving.simulator.trtllm_options import simulator_settings

# The repository lives next to a ``shared/`` folder on the development machines; CI clones may not have
# it, so a copy of the same calibration file ships inside the package (see ``resolved_calibration_path``).
SHARED_CALIBRATION_PATH = (
    Path(__file__).resolve().parents[2].parent / "shared/calibration/h100_prefill_decode.json"
)
BUNDLED_CALIBRATION_PATH = Path(__file__).resolve().parent / "calibration_h100.json"

CalibrationModel = Literal["qwen2.5-32b", "llama3-8b"]
Role = Literal["aggregated", "context", "generation"]


class SimulatorConfig(BaseSettings):
    """Everything that shapes one replica's behaviour; printed as one JSON line on start.

    Times in the cost model are milliseconds of simulated GPU work; ``time_scale`` converts them to wall
    time (0.01 = 100x faster than a real H100, 0 = no sleeping at all, for CPU-bound throughput tests).
    """

    model_config = SettingsConfigDict(env_prefix="SIM_", protected_namespaces=(), extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(
        default=8001, ge=0, le=65535, description="0 picks a free port (printed in the READY line)"
    )
    replica_id: str = "r0"
    model_name: str = "qwen2.5-32b-sim"
    calibration_model: CalibrationModel = Field(
        default="qwen2.5-32b",
        description="the model's shape: its weights, KV bytes per token and FLOPs (and, with the "
        "eager_pytorch cost model, its calibration table)",
    )
    gpu: GpuKind = Field(default="h100-80gb", description="the GPU kind one replica stands for")
    weight_dtype: WeightDtype = Field(default="bf16", description="weights in memory and GEMM peak")
    kv_cache_dtype: KvCacheDtype = Field(
        default="auto",
        description="KV cache data type; auto follows the weights (trtllm's kv_cache_config.dtype)",
    )
    free_gpu_memory_fraction: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="share of the memory left after weights and activations given to KV blocks "
        "(trtllm's kv_cache_config.free_gpu_memory_fraction)",
    )
    cost_model: CostModelKind = Field(
        default="roofline",
        description="roofline: one fused pass per iteration on the GPU's roofline, calibrated to "
        "TensorRT-LLM's published H100 throughput; eager_pytorch: the measured eager table",
    )
    calibration_path: Path = SHARED_CALIBRATION_PATH
    time_scale: float = Field(default=1.0, ge=0.0)
    block_size: int = Field(default=32, ge=1, description="tokens per KV block, as trtllm's tokens_per_block")
    cache_capacity_blocks: int = Field(
        default=0,
        ge=0,
        description="KV blocks; 0 sizes them from the GPU's memory (hardware.kv_memory: 1,848 for the "
        "32B model in bf16 on an H100)",
    )
    kv_event_buffer_max_size: int = Field(
        default=0,
        ge=0,
        description="KV cache events kept for POST /kv_cache_events pollers, as trtllm's "
        "kv_cache_config.event_buffer_max_size; 0 disables events (the endpoint answers 404)",
    )
    max_batch: int = Field(
        default=64, ge=1, description="running requests per iteration (trtllm max_batch_size)"
    )
    max_num_tokens: int = Field(default=8192, ge=1, description="prefill + decode tokens per iteration")
    max_seq_len: int = Field(
        default=0,
        ge=0,
        description="prompt + max_tokens longer than this is refused (400); 0: the model's "
        "max_position_embeddings, as trtllm-serve",
    )
    enable_chunked_prefill: bool = Field(
        default=False,
        description="split prefills into chunks that fill the iteration's max_num_tokens left after the "
        "running requests' decode tokens (trtllm enable_chunked_prefill; off by default, as there)",
    )
    chunk_block_reuse: bool = Field(
        default=False,
        description="with chunked prefill: a partly prefilled prompt's full blocks become reusable after "
        "each chunk (as vLLM's and SGLang's prefix caches do) instead of after its last chunk",
    )
    context_chunking_policy: ChunkingPolicy = Field(
        default="first_come_first_served",
        description="with chunked prefill: first_come_first_served (the oldest prompt takes all it can, "
        "trtllm's default) or equal_progress (one KV block per prompt in turn)",
    )
    mixed_batch_cost: MixedBatchCost = Field(
        default="additive",
        description="eager_pytorch cost only: an iteration that prefills and decodes costs prefill + "
        "decode step (additive) or the larger of the two (fused); the roofline is always one fused pass",
    )
    pin_running_blocks: bool = Field(
        default=True,
        description="running requests hold their KV blocks (prompt and generated tokens) and admission "
        "waits for room (KV memory); always on in the context and generation roles",
    )
    capacity_policy: CapacityPolicy = Field(
        default="guaranteed_no_evict",
        description="guaranteed_no_evict: admit only when prompt + max_tokens fits (trtllm's default); "
        "max_utilization: admit on the prompt, pause the most recently started requests when full",
    )
    enable_partial_reuse: bool = Field(
        default=True,
        description="reuse the matching leading tokens of a stored partly filled block "
        "(trtllm's kv_cache_config.enable_partial_reuse, on by default there)",
    )
    defer_shared_prefixes: bool = Field(
        default=True,
        description="hold back a prompt whose first uncached block a prompt admitted in the same "
        "iteration computes, so it reuses it next iteration (trtllm's beneficialToSkip)",
    )
    disconnect_poll_s: float = Field(
        default=1.0,
        ge=0.0,
        description="a non-streaming request's client disconnect is noticed at the next poll, every this "
        "many simulated seconds (trtllm-serve polls is_disconnected() every second)",
    )
    role: Role = Field(
        default="aggregated",
        description="aggregated (prefill and decode here), context (answers disaggregated context_only "
        "requests and keeps their KV cache for a generation replica to pull) or generation (answers "
        "generation_only requests by pulling the prompt's KV cache from the context replica)",
    )
    advertise_url: str | None = Field(
        default=None,
        description="context role: the base URL generation replicas pull KV caches from (in "
        "opaque_state); default: scheme, host and port the context_only request was sent to",
    )
    kv_transfer_latency_ms: float = Field(
        default=0.5, ge=0.0, description="fixed cost of one KV cache transfer, simulated ms"
    )
    kv_link_gbps: float = Field(
        default=400.0,
        gt=0.0,
        description="KV transfer bandwidth in gigabits/s (400: one NDR InfiniBand NIC per H100, 50 GB/s)",
    )
    kv_send_slots: int = Field(
        default=4, ge=1, description="context role: KV transfers sent at once (the cache transceiver's)"
    )
    kv_recv_slots: int = Field(default=4, ge=1, description="generation role: KV transfers received at once")
    kv_transfer_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="context role: a finished prompt's KV blocks stay pinned this long for a pull, then "
        "are released (simulated seconds, scaled by time_scale; wall seconds at time_scale 0)",
    )
    perf_metrics_max_requests: int = Field(
        default=1000,
        ge=0,
        description="finished requests' timelines kept for GET /perf_metrics (trtllm's "
        "perf_metrics_max_requests); 0 keeps none",
    )
    default_max_tokens: int = Field(default=200, ge=1)
    slowdown: float = Field(
        default=1.0,
        gt=0.0,
        description="multiplies every iteration's time: a slower accelerator kind (2 = half the speed), "
        "or a degraded replica (fault injection)",
    )
    network_rtt_ms: float = Field(
        default=0.0,
        ge=0.0,
        description="wall milliseconds added before each answer starts, not scaled by time_scale: the "
        "round trip to a replica in another region",
    )
    error_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="share of requests answered 503")
    bad_answer: BadAnswer = Field(
        default="none",
        description="answer with this kind of bad 200 (serving.simulator.bad_answers; fault injection)",
    )
    bad_answer_rate: float = Field(
        default=1.0, ge=0.0, le=1.0, description="share of requests given the bad answer, when one is set"
    )
    seed: int = 0
    stream_coalesce_s: float = Field(
        default=0.02,
        ge=0.0,
        description="a stream writes at most one chunk per this many wall seconds (first and last chunk "
        "excepted), so fast time scales do not cost one write per token",
    )

    extra_llm_api_options: Path | None = Field(
        default=None,
        description="a trtllm-serve --extra_llm_api_options YAML (serving/trtllm/aggregated.yaml is ours): "
        "the options it sets that the simulator models become its settings; flags and SIM_* win",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_trtllm_options(cls, data: Any) -> Any:
        """Fill what the options file sets and nothing set explicitly already does."""
        if not isinstance(data, dict) or not data.get("extra_llm_api_options"):
            return data
        settings, _ = simulator_settings(Path(data["extra_llm_api_options"]))
        return {**settings, **data}

    @model_validator(mode="after")
    def _size_from_hardware(self) -> SimulatorConfig:
        """Fill the settings that follow from the hardware when left at 0."""
        if self.cache_capacity_blocks == 0:
            self.cache_capacity_blocks = self.kv_memory().blocks
        if self.max_seq_len == 0:
            self.max_seq_len = MODELS[self.calibration_model].max_position_embeddings
        if self.enable_chunked_prefill and self.max_num_tokens < self.block_size:
            # Chunks are whole blocks: no prompt could ever be given one, and the engine would spin.
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) is below block_size ({self.block_size}): "
                "with chunked prefill an iteration must hold at least one block of a prompt"
            )
        return self

    def kv_memory(self) -> KvMemory:
        """How the GPU's memory sizes the KV cache (``hardware.kv_memory``), whatever the override."""
        return kv_memory(
            self.calibration_model,
            self.gpu,
            self.weight_dtype,
            self.kv_cache_dtype,
            free_gpu_memory_fraction=self.free_gpu_memory_fraction,
            tokens_per_block=self.block_size,
            max_num_tokens=self.max_num_tokens,
        )

    def resolved_calibration_path(self) -> Path:
        """The configured calibration file, or the bundled copy when that file is missing."""
        if self.calibration_path.is_file():
            return self.calibration_path
        return BUNDLED_CALIBRATION_PATH
