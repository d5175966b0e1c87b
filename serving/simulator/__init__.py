"""A fast simulator of ONE TensorRT-LLM (``trtllm-serve``) replica, for tests and benchmarks.

It speaks the OpenAI-compatible API, keeps a block prefix cache, and delays responses by a latency model
calibrated on an H100 (``cost_model``), simulating time with ``asyncio`` sleeps so eight replicas fit on
two CPU cores. Its answers are deterministic stand-ins (``answers``), not model output. See
``docs/simulator.md`` for what it models and what it leaves out.
"""

from serving.simulator.app import create_app
from serving.simulator.config import SimulatorConfig

__all__ = ["SimulatorConfig", "create_app"]
