"""The production trtllm-serve configs say what docs/serving.md says they say, and the P/D front end's
conditional rule matches our client's (``llm_client.routing.pd_aware``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from llm_client.routing.pd_aware import PdAwareSettings

DISAGG = Path(__file__).resolve().parents[2] / "serving" / "trtllm" / "disagg"


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DISAGG / name).read_text())
    return document


def test_generation_servers_reuse_blocks_and_publish_their_events() -> None:
    gen = load("gen_extra_llm_api_options.yaml")["kv_cache_config"]
    ctx = load("ctx_extra_llm_api_options.yaml")["kv_cache_config"]
    assert gen["enable_block_reuse"] is True and gen["event_buffer_max_size"] > 0
    assert gen["tokens_per_block"] == ctx["tokens_per_block"] == PdAwareSettings().decode.block_size


def test_the_front_end_routes_both_pools_by_kv_cache_and_disaggregates_conditionally() -> None:
    config = load("disagg_config.yaml")
    assert config["context_servers"]["router"]["type"] == "kv_cache_aware"
    assert config["generation_servers"]["router"]["type"] == "kv_cache_aware"
    for pool in ("context_servers", "generation_servers"):
        assert config[pool]["num_instances"] == len(config[pool]["urls"])
    local = config["conditional_disagg_config"]["max_local_prefill_length"]
    assert local == PdAwareSettings().max_local_prefill_tokens
