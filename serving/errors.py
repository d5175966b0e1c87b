"""The serving package's errors (the simulator's; ``trtllm/`` holds configs only)."""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class SimulatorStartFailed(ShopperError, RuntimeError):
    """A simulator replica exited before it printed READY; its output says why."""


class SimulatorConfigError(ShopperError, ValueError):
    """A simulator setting, or a trtllm options file given to it, that it cannot take; says which."""
