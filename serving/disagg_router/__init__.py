"""A stand-in for ``trtllm-serve disaggregated``: TensorRT-LLM's own front end for prefill/decode
disaggregation (its routers and ``conditional_disagg_config``), in front of simulator replicas, so our
P/D-aware client routing has TensorRT-LLM's native behaviour to be measured against.

``python -m serving.disagg_router --config serving/trtllm/disagg/disagg_config.yaml --port 8000
[--context-urls ...] [--generation-urls ...]``. Modules: ``config`` (the YAML), ``routers/`` (one module
per TensorRT-LLM router), ``service`` (one request: the conditional rule, ``context_only`` then
``generation_only``), ``workers`` (HTTP to the servers, retries), ``perf_metrics`` (``GET /perf_metrics``),
``app`` (the routes). Rebuilt from ``tensorrt_llm/serve/router.py``, ``openai_disagg_service.py``,
``openai_client.py``, ``perf_metrics.py`` and ``tensorrt_llm/llmapi/disagg_utils.py``.
"""
