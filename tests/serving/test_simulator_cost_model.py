"""The cost model reproduces its calibration points and behaves sensibly between and beyond them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from serving.simulator.config import BUNDLED_CALIBRATION_PATH, SimulatorConfig
from serving.simulator.cost_model import CalibrationError, CostModel, PiecewiseLinear

CALIBRATION = SimulatorConfig().resolved_calibration_path()
MODELS = ("qwen2.5-32b", "llama3-8b")


def _results(model: str) -> dict[str, Any]:
    data = json.loads(CALIBRATION.read_text())
    return next(r for r in data["results"] if r["model"] == model)


@pytest.mark.parametrize("model", MODELS)
def test_reproduces_every_primary_calibration_point_within_10_percent(model: str) -> None:
    cost = CostModel.from_calibration(CALIBRATION, model)
    r = _results(model)
    for tokens, ms in r["prefill_ms"].items():
        assert cost.prefill_ms(int(tokens)) == pytest.approx(ms, rel=0.10)
    for key, ms in r["suffix_on_cached_prefix_ms"].items():
        prefix, suffix = map(int, key.split("+"))
        assert cost.prefill_ms(suffix, prefix) == pytest.approx(ms, rel=0.10)
    for batch, ms in r["decode_step_ms_ctx2048"].items():
        assert cost.decode_step_ms(int(batch), int(batch) * 2048) == pytest.approx(ms, rel=0.10)


def test_cold_prefill_extrapolates_linearly_and_stays_monotone() -> None:
    cost = CostModel.from_calibration(CALIBRATION, "qwen2.5-32b")
    slope = (cost.prefill_ms(8192) - cost.prefill_ms(4096)) / 4096
    assert cost.prefill_ms(16384) == pytest.approx(cost.prefill_ms(8192) + slope * 8192)
    values = [cost.prefill_ms(n) for n in range(1, 20000, 97)]
    assert values == sorted(values)
    assert cost.prefill_ms(0) == 0.0


def test_cached_prefix_costs_much_less_than_cold_and_zero_cache_is_cold() -> None:
    cost = CostModel.from_calibration(CALIBRATION, "qwen2.5-32b")
    assert cost.prefill_ms(256, 0) == cost.prefill_ms(256)
    assert cost.prefill_ms(256, 4096) < 0.2 * cost.prefill_ms(4352)
    # Beyond the largest measured prefix the excess is held, not extrapolated.
    assert cost.prefill_ms(256, 65536) == pytest.approx(cost.prefill_ms(256, 8192))


def test_decode_grows_with_batch_and_context() -> None:
    cost = CostModel.from_calibration(CALIBRATION, "qwen2.5-32b")
    assert cost.decode_step_ms(64, 64 * 2048) > cost.decode_step_ms(16, 16 * 2048)
    assert cost.decode_step_ms(16, 16 * 8192) > cost.decode_step_ms(16, 16 * 2048)
    assert cost.decode_step_ms(0, 0) == 0.0


def test_bundled_copy_matches_and_is_used_when_shared_file_is_missing(tmp_path: Path) -> None:
    config = SimulatorConfig(calibration_path=tmp_path / "missing.json")
    assert config.resolved_calibration_path() == BUNDLED_CALIBRATION_PATH
    bundled = CostModel.from_calibration(BUNDLED_CALIBRATION_PATH, "qwen2.5-32b")
    assert bundled.prefill_ms(4096) == pytest.approx(_results("qwen2.5-32b")["prefill_ms"]["4096"])


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(CalibrationError, match="no results for 'gpt-9'"):
        CostModel.from_calibration(CALIBRATION, "gpt-9")


def test_piecewise_linear_clamps_when_asked() -> None:
    curve = PiecewiseLinear.from_points({0.0: 0.0, 10.0: 10.0}, extrapolate=False)
    assert curve(-5) == 0.0 and curve(5) == 5.0 and curve(50) == 10.0
    assert PiecewiseLinear.from_points({0.0: 0.0, 10.0: 10.0})(20) == 20.0
    assert PiecewiseLinear.from_points({3.0: 7.0})(100) == 7.0
