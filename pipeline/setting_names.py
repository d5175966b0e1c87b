"""One name per setting: an engine's nested component settings must not be set under two names.

The runner and the Flink job nest their components' settings (``RunnerSettings.llm`` is the LLM
client's ``ClientConfig``, read from ``LLM_*`` on its own), so a field has two environment names:
``RUNNER_LLM__MODEL`` and ``LLM_MODEL``. pydantic-settings merges them field by field and the nested
name wins, silently. The nested name can also be the component's whole JSON
(``RUNNER_SINKS='{"redis_url": ...}'``), whose keys are names too. Setting both is refused instead,
naming both variables (never their values), so a deployment cannot believe it set a value that another
name overrides. Setting either one alone works.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from prompt_assembly.errors import ConfigurationError


def settings_named_twice(
    environ: Mapping[str, str], engine_prefix: str, components: Mapping[str, str]
) -> list[tuple[str, str]]:
    """(nested name, own name) of each field set under both, e.g. ``("RUNNER_LLM__MODEL",
    "LLM_MODEL")``; ``components`` maps a nested field to its own prefix (``{"llm": "LLM_"}``).
    Names compare case-insensitively, as pydantic-settings reads them."""
    present = {name.upper(): name for name in environ}
    twice = []
    for field, own_prefix in components.items():
        nested_prefix = f"{engine_prefix}{field}__".upper()
        nested: list[tuple[str, str]] = [
            (name, upper[len(nested_prefix) :])
            for upper, name in present.items()
            if upper.startswith(nested_prefix)
        ]
        whole = present.get(f"{engine_prefix}{field}".upper())
        if whole is not None:  # the JSON form, RUNNER_SINKS='{"redis_url": ...}', names fields too
            nested += [(f"{whole}.{key}", key.upper()) for key in _json_keys(environ[whole])]
        for name, suffix in nested:
            own = f"{own_prefix}{suffix}".upper()
            if own in present:
                twice.append((name, present[own]))
    return sorted(twice)


def _json_keys(value: str) -> list[str]:
    """The top-level keys of a JSON object setting; none when it is not one (pydantic reports that)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return []
    return [str(key) for key in parsed] if isinstance(parsed, dict) else []


def refuse_settings_named_twice(
    environ: Mapping[str, str], engine_prefix: str, components: Mapping[str, str]
) -> None:
    twice = settings_named_twice(environ, engine_prefix, components)
    if twice:
        pairs = "; ".join(f"{nested} and {own}" for nested, own in twice)
        raise ConfigurationError(f"a setting is set under two names ({pairs}): keep one of each pair")
