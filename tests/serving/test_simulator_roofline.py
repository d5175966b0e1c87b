"""The default iteration cost is one fused pass on the GPU's roofline, and it obeys the physics it claims."""

from __future__ import annotations

from serving.simulator.config import SimulatorConfig
from serving.simulator.cost_model import CostModel, IterationWork
from serving.simulator.hardware import GPUS, MODELS
from serving.simulator.replica import iteration_cost
from serving.simulator.roofline import MBU, OVERHEAD_MS, RooflineCost

COST = RooflineCost.for_hardware("qwen2.5-32b", "h100-80gb", "bf16", "bf16")


def test_defaults_pick_the_roofline_and_the_eager_table_stays_an_option() -> None:
    assert isinstance(iteration_cost(SimulatorConfig()), RooflineCost)
    assert isinstance(iteration_cost(SimulatorConfig(cost_model="eager_pytorch")), CostModel)


def test_a_lone_decode_step_is_the_weight_read() -> None:
    """Batch 1 is bound by reading every weight once: never faster than the HBM allows, and no slower
    than the fitted bandwidth share plus the per-step overhead and one token's KV."""
    model, gpu = MODELS["qwen2.5-32b"], GPUS["h100-80gb"]
    floor_ms = model.params * 2 / gpu.hbm_bytes_per_s * 1000
    step = COST.decode_step_ms(1, 2048)
    kv_ms = 2049 * COST.kv_bytes_per_token / (gpu.hbm_bytes_per_s * MBU) * 1000
    assert floor_ms < step <= model.params * 2 / (gpu.hbm_bytes_per_s * MBU) * 1000 + OVERHEAD_MS + kv_ms


def test_one_pass_costs_less_than_its_parts_apart_and_more_than_either() -> None:
    prefill, decode = (2000, 0), (32, 32 * 2500)
    mixed = COST.iteration_ms(IterationWork((prefill,), *decode))
    alone_prefill = COST.iteration_ms(IterationWork((prefill,), 0, 0))
    alone_decode = COST.iteration_ms(IterationWork((), *decode))
    assert max(alone_prefill, alone_decode) < mixed < alone_prefill + alone_decode


def test_cost_grows_with_tokens_context_and_slower_hardware() -> None:
    assert COST.prefill_ms(4096) > 1.9 * COST.prefill_ms(2048)  # compute-bound: about linear
    assert COST.decode_step_ms(64, 64 * 8192) > COST.decode_step_ms(64, 64 * 2048)  # KV bytes read
    assert COST.prefill_ms(256, 8192) > COST.prefill_ms(256)  # attention over a cached prefix
    h200 = RooflineCost.for_hardware("qwen2.5-32b", "h200-141gb", "bf16", "bf16")
    assert h200.decode_step_ms(32, 32 * 2048) < COST.decode_step_ms(32, 32 * 2048)  # more bandwidth
    fp8 = RooflineCost.for_hardware("qwen2.5-32b", "h100-80gb", "fp8", "fp8")
    assert fp8.prefill_ms(4096) < COST.prefill_ms(4096) and fp8.decode_step_ms(1, 2048) < COST.decode_step_ms(
        1, 2048
    )
    assert COST.iteration_ms(IterationWork((), 0, 0)) == 0.0
