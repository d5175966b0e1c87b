"""A ``trtllm-serve --extra_llm_api_options`` YAML, read as simulator settings.

The fleet we ship is configured by ``serving/trtllm/aggregated.yaml``. A simulated fleet that took the
simulator's defaults instead (trtllm-serve's own defaults) would run, for instance, without the chunked
prefill that file turns on, and every benchmark on it would measure a deployment nobody gets. So the
simulator reads the same file (``--extra-llm-api-options``): each option it models becomes the setting
of the same meaning, and the options it does not model are named, not guessed at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from serving.errors import SimulatorConfigError

AGGREGATED_YAML = Path(__file__).resolve().parents[1] / "trtllm" / "aggregated.yaml"
"""The options of one aggregated replica as we ship them (docs/serving.md)."""


def _policy(names: Mapping[str, str]) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if str(value) not in names:
            raise SimulatorConfigError(f"unknown value {value!r}; the simulator models {sorted(names)}")
        return names[str(value)]

    return convert


def _same(value: Any) -> Any:
    return value


MODELLED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "max_batch_size": ("max_batch", _same),
    "max_num_tokens": ("max_num_tokens", _same),
    "max_seq_len": ("max_seq_len", _same),
    "enable_chunked_prefill": ("enable_chunked_prefill", _same),
    "perf_metrics_max_requests": ("perf_metrics_max_requests", _same),
    "kv_cache_config.tokens_per_block": ("block_size", _same),
    "kv_cache_config.enable_partial_reuse": ("enable_partial_reuse", _same),
    "kv_cache_config.free_gpu_memory_fraction": ("free_gpu_memory_fraction", _same),
    "kv_cache_config.event_buffer_max_size": ("kv_event_buffer_max_size", _same),
    "kv_cache_config.dtype": ("kv_cache_dtype", _same),
    "scheduler_config.capacity_scheduler_policy": (
        "capacity_policy",
        _policy({"GUARANTEED_NO_EVICT": "guaranteed_no_evict", "MAX_UTILIZATION": "max_utilization"}),
    ),
    "scheduler_config.context_chunking_policy": (
        "context_chunking_policy",
        _policy({"FIRST_COME_FIRST_SERVED": "first_come_first_served", "EQUAL_PROGRESS": "equal_progress"}),
    ),
}
"""Option (dotted) -> simulator setting, and how its value converts."""

ALWAYS_ON = {"kv_cache_config.enable_block_reuse"}
"""Options the simulator always behaves as if true: a file that turns one off is refused."""


def _flatten(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name in {"kv_cache_config", "scheduler_config"}:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def simulator_settings(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The simulator settings the options file at ``path`` sets, and the options it has that the
    simulator does not model (guided decoding, the KV transceiver...), which change nothing here."""
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SimulatorConfigError(f"cannot read trtllm options {path}: {exc}") from exc
    if not isinstance(document, Mapping):
        raise SimulatorConfigError(f"trtllm options {path}: a mapping of options expected")
    settings: dict[str, Any] = {}
    ignored: list[str] = []
    for option, value in _flatten(document).items():
        if option in ALWAYS_ON:
            if value is not True:
                raise SimulatorConfigError(f"{path}: {option}={value!r}; the simulator always reuses blocks")
        elif option in MODELLED:
            setting, convert = MODELLED[option]
            try:
                settings[setting] = convert(value)
            except SimulatorConfigError as exc:
                raise SimulatorConfigError(f"{path}: {option}: {exc}") from exc
        else:
            ignored.append(option)
    return settings, sorted(ignored)
