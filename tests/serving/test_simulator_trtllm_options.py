"""The simulator reads a trtllm-serve options file as trtllm-serve does, so a simulated fleet runs the
options we ship (``serving/trtllm/aggregated.yaml``), and the stack's replicas do so by default."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import yaml

from devstack.stack import StackSettings, StackState
from llm_client.routing.pd_aware import PdAwareSettings
from serving.errors import SimulatorConfigError
from serving.simulator.__main__ import parse_args
from serving.simulator.config import SimulatorConfig
from serving.simulator.trtllm_options import AGGREGATED_YAML, simulator_settings

DISAGG = AGGREGATED_YAML.parent / "disagg"


def test_the_shipped_file_turns_on_what_trtllm_serve_would() -> None:
    shipped = yaml.safe_load(AGGREGATED_YAML.read_text())
    config = parse_args(["--extra-llm-api-options", str(AGGREGATED_YAML)])
    assert config.enable_chunked_prefill is shipped["enable_chunked_prefill"] is True
    kv = shipped["kv_cache_config"]
    assert config.free_gpu_memory_fraction == kv["free_gpu_memory_fraction"]
    assert config.kv_event_buffer_max_size == kv["event_buffer_max_size"] > 0
    assert config.block_size == kv["tokens_per_block"] == PdAwareSettings().decode.block_size
    # The file's KV share sizes the cache, as on the GPU.
    by_share = SimulatorConfig(free_gpu_memory_fraction=kv["free_gpu_memory_fraction"])
    assert config.cache_capacity_blocks == by_share.cache_capacity_blocks


def test_options_it_does_not_model_are_named_not_guessed() -> None:
    _, ignored = simulator_settings(AGGREGATED_YAML)
    assert ignored == ["guided_decoding_backend"]
    settings, ignored = simulator_settings(DISAGG / "ctx_extra_llm_api_options.yaml")
    assert settings["enable_chunked_prefill"] is True
    assert "cache_transceiver_config" in ignored and "disable_overlap_scheduler" in ignored


def test_flags_and_environment_win_over_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    default_blocks = SimulatorConfig().cache_capacity_blocks
    monkeypatch.setenv("SIM_FREE_GPU_MEMORY_FRACTION", "0.5")
    config = parse_args(
        ["--extra-llm-api-options", str(AGGREGATED_YAML), "--enable-chunked-prefill", "false"]
    )
    assert (config.enable_chunked_prefill, config.free_gpu_memory_fraction) == (False, 0.5)
    # A smaller KV share than trtllm's default 0.9 leaves fewer blocks, as on the GPU.
    assert config.cache_capacity_blocks < default_blocks
    assert config.kv_event_buffer_max_size == 16384  # from the file, which nothing overrode


def test_scheduler_policies_convert_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    options = tmp_path / "options.yaml"
    options.write_text(
        "scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n"
        "  context_chunking_policy: EQUAL_PROGRESS\nmax_batch_size: 16\n"
    )
    config = SimulatorConfig(extra_llm_api_options=options)
    assert (config.capacity_policy, config.context_chunking_policy, config.max_batch) == (
        "max_utilization",
        "equal_progress",
        16,
    )
    options.write_text("scheduler_config:\n  capacity_scheduler_policy: STATIC_BATCH\n")
    with pytest.raises(SimulatorConfigError, match=r"capacity_scheduler_policy.*STATIC_BATCH"):
        simulator_settings(options)


def test_a_file_the_simulator_cannot_honour_is_refused(tmp_path: Path) -> None:
    options = tmp_path / "options.yaml"
    options.write_text("kv_cache_config:\n  enable_block_reuse: false\n")
    with pytest.raises(SimulatorConfigError, match="enable_block_reuse"):
        simulator_settings(options)
    options.write_text("- not\n- a mapping\n")
    with pytest.raises(SimulatorConfigError, match="mapping"):
        simulator_settings(options)
    with pytest.raises(SimulatorConfigError, match="cannot read"):
        simulator_settings(tmp_path / "missing.yaml")


def test_the_stack_serves_with_the_shipped_options_by_default() -> None:
    assert StackSettings().replica_options == AGGREGATED_YAML


async def test_the_stacks_replicas_run_the_shipped_options(stack: StackState) -> None:
    """The session's replicas were started by ``stack_up`` at its defaults: their KV events are on, as
    only the shipped file turns them on (trtllm-serve's default, and the simulator's, is off)."""
    if not any(p.name.startswith("sim-") for p in stack.processes):
        pytest.fail("the session's stack started no simulator replicas")
    async with aiohttp.ClientSession() as http:
        for url in stack.llm_endpoints:
            async with http.post(f"{url}/kv_cache_events") as response:
                assert response.status == 200, url
