"""Model serving: everything that stands between the pipeline's LLM client and a GPU.

- ``serving.simulator``: a CPU-cheap stand-in for one TensorRT-LLM (``trtllm-serve``) replica, speaking the
  same OpenAI-compatible API with a block prefix cache and a latency model calibrated on an H100. Tests and
  benchmarks run up to ~8 of them on a laptop-class machine instead of renting GPUs.
- ``serving/trtllm/``: the production ``trtllm-serve`` configurations (aggregated with KV block reuse, and
  prefill/decode disaggregation), documented in ``docs/serving.md``.
- A launcher for a real small model under ``llama-server`` will live beside these later.
"""
