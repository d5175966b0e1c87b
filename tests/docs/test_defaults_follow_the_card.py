"""A default that stands for a card's size is that card's size, computed, not a copy that can drift.

``PrefixAwareSettings.max_blocks_per_replica`` bounds each replica's index at about the replica's KV
capacity. Its default names one replica: an H100 80GB serving Qwen2.5-32B in bf16, the simulator's
default replica, whose blocks ``serving.simulator.hardware.kv_memory`` computes as TensorRT-LLM sizes its
cache. The client cannot import the simulator (it runs against real engines), so the number is written
twice; this test keeps the two equal, so a change to the hardware model fails here, not in a benchmark
whose index quietly outgrew the cache it tracks."""

from __future__ import annotations

from llm_client.routing.prefix_aware import PrefixAwareSettings
from serving.simulator.config import SimulatorConfig


def test_the_index_bound_defaults_to_the_default_replicas_kv_blocks() -> None:
    replica = SimulatorConfig()
    memory = replica.kv_memory()
    assert (replica.gpu, memory.model, memory.weight_dtype) == ("h100-80gb", "Qwen2.5-32B", "bf16")
    assert PrefixAwareSettings().max_blocks_per_replica == memory.blocks == replica.cache_capacity_blocks
