"""API-key authentication of callers (pure; the HTTP guard in ``realtime.guards`` applies it).

Keys are compared in constant time: the presented key and every configured key are hashed with SHA-256
(so the comparison does not even leak a key's length) and every configured key is compared with
``hmac.compare_digest``, without stopping at the first match. The service keeps only the digests.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from pydantic import SecretStr

BEARER = "bearer "


def presented_key(authorization: str | None, api_key_header: str | None) -> str | None:
    """The key a request presents: ``X-API-Key: <key>`` or ``Authorization: Bearer <key>``."""
    if api_key_header:
        return api_key_header.strip()
    if authorization and authorization[: len(BEARER)].lower() == BEARER:
        return authorization[len(BEARER) :].strip()
    return None


class ApiKeyAuthenticator:
    """Accepts the configured keys; with none configured, authentication is off (``required`` False)."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        self._digests = [_digest(k.get_secret_value()) for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def client_id(self, key: str | None) -> str | None:
        """A stable, non-secret name for the caller holding ``key`` (``key:<12 hex>``), or None when the
        key is missing or not one of the configured keys. Used to key the rate limit and in metrics."""
        if key is None or not self._digests:
            return None
        presented = _digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return f"key:{presented.hex()[:12]}" if matched else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
