"""How the client authenticates to LLM endpoints and verifies them: a bearer API key and a CA bundle.

Hosted OpenAI-compatible endpoints (and gateways in front of vLLM/SGLang/TensorRT-LLM) take
``Authorization: Bearer <key>``; private deployments often sign their certificates with an internal CA.
Both apply to every request of the client's one HTTP session (completions and health probes).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import quote

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


_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def header_value(text: str) -> str:
    """``text`` as an HTTP header value: printable ASCII kept, everything else (control characters,
    which aiohttp refuses with a ValueError, and non-ASCII) percent-encoded as UTF-8; ``%`` itself is
    encoded too, so distinct keys stay distinct. Routing keys (shopper ids) come from producers and
    the real-time API: without this, one id with a control character failed every call for it."""
    return quote(text, safe=_HEADER_SAFE)
