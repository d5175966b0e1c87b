"""Async client for OpenAI-compatible LLM servers (trtllm-serve in production; llama-server and the
simulator locally), with pluggable routing across replicas, retries under a budget, deadlines,
backpressure and health checks. The same code talks to every server kind."""

from llm_client.client import LLMClient
from llm_client.config import ClientConfig, RetrySettings, Timeouts
from llm_client.hooks import Attempt, ClientHooks
from llm_client.models import Completion

__all__ = ["Attempt", "ClientConfig", "ClientHooks", "Completion", "LLMClient", "RetrySettings", "Timeouts"]
