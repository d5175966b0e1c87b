"""How the client authenticates to LLM endpoints and verifies them: a bearer API key and a CA bundle.

Hosted OpenAI-compatible endpoints (and gateways in front of vLLM/SGLang/TensorRT-LLM) take
``Authorization: Bearer <key>``; private deployments often sign their certificates with an internal CA.
Both apply to every request of the client's one HTTP session (completions and health probes).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr


class EndpointSecurity(BaseModel):
    """``LLM_SECURITY__API_KEY``, ``LLM_SECURITY__CA_FILE`` (nested in ``ClientConfig.security``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: SecretStr | None = Field(None, description="sent as 'Authorization: Bearer <key>'")
    ca_file: FilePath | None = Field(
        None, description="PEM CA bundle trusted for https:// endpoints, instead of the system's"
    )


def auth_headers(security: EndpointSecurity) -> dict[str, str]:
    """Default headers of the client's session (empty without a key)."""
    if security.api_key is None:
        return {}
    return {"Authorization": f"Bearer {security.api_key.get_secret_value()}"}


def tls_context(security: EndpointSecurity) -> ssl.SSLContext | bool:
    """What ``aiohttp.TCPConnector(ssl=...)`` takes: a context trusting ``ca_file`` only (hostname
    checked), or True for the default verification against the system CAs."""
    if security.ca_file is None:
        return True
    return ssl.create_default_context(cafile=str(Path(security.ca_file).resolve()))
