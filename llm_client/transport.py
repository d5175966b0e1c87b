"""How the client talks to LLM endpoints: a bearer API key, a CA bundle, and the one translation of
transport failures into the client's errors (``mapped_transport_errors``).

Hosted OpenAI-compatible endpoints (and gateways in front of vLLM/SGLang/TensorRT-LLM) take
``Authorization: Bearer <key>``; private deployments often sign their certificates with an internal CA.
Both apply to every request of the client's one HTTP session (completions and health probes).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr

from llm_client.errors import (
    AttemptTimeout,
    ConnectionFailed,
    EndpointUnavailable,
    InvalidAnswer,
    LLMError,
)

SessionSource = Callable[[], aiohttp.ClientSession]
"""The client's one HTTP session, for the parts that talk to replicas (``LLMClient`` opens it in
``start``; asking before that is a bug, and says so)."""


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


@contextlib.contextmanager
def mapped_transport_errors(endpoint: str, attempt_s: float | None = None) -> Iterator[None]:
    """Every way an exchange with a replica can fail, as one of the client's errors (as httpx's
    ``map_httpcore_exceptions`` does): the one place where aiohttp, socket and timeout exceptions are
    translated. ``LLMError`` passes through; anything else is a bug and passes through too.

    - a slow connect or read (``ServerTimeoutError``, ``TimeoutError``): ``AttemptTimeout``;
    - refused, reset, closed mid-answer, a truncated body: ``ConnectionFailed`` (ejects at once);
    - a malformed HTTP exchange (a bad status line or header, a header or line over aiohttp's own
      limits, which it raises as ``LineTooLong``/``BadHttpMessage``): ``InvalidAnswer``.
    """
    try:
        yield
    except LLMError:
        raise
    except aiohttp.ServerTimeoutError:
        raise AttemptTimeout("connect or read timed out", endpoint=endpoint) from None
    except TimeoutError:
        limit = "its time limit" if attempt_s is None else f"{attempt_s} s"
        raise AttemptTimeout(f"attempt exceeded {limit}", endpoint=endpoint) from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
        raise ConnectionFailed(f"connection failed: {exc!r}", endpoint=endpoint) from None
    except (aiohttp.ClientResponseError, HttpProcessingError) as exc:
        message = f"malformed HTTP answer: {exc!r}"[:500]
        raise InvalidAnswer(message, kind="wrong_shape", endpoint=endpoint) from None
    except aiohttp.ClientError as exc:
        raise EndpointUnavailable(f"HTTP client error: {exc!r}"[:500], endpoint=endpoint) from None
