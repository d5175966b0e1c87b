"""The routing gateway: an OpenAI-compatible HTTP proxy in front of the LLM replicas.

Any caller that speaks OpenAI (a JVM service, Flink SQL ``ML_PREDICT``, curl) gets the same routing
policies, retries, health checks and KV awareness as the in-process ``llm_client``; answers, streamed or
not, pass through byte for byte. ``create_app`` builds the aiohttp application, ``shopper router serve``
runs it.
"""

from gateway.app import create_app
from gateway.config import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
