"""Printing configuration without its secrets.

Every component prints its settings on start (STYLE.md), and those settings hold passwords, API keys
and URLs that may carry credentials. ``redacted_config_dump`` is what they print instead of
``model_dump_json``: ``SecretStr`` fields come out as ``"**********"``, any field whose name says it is a
secret is masked whatever its type, and every string that is a URL with a password keeps its host but
loses the password (``mask_url``). The result is meant for logs; it is not a way to save settings.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from pydantic import BaseModel, SecretStr

MASK = "**********"

_SECRET_NAME = re.compile(r"(password|passwd|secret|token|api_?key|credential|jaas)", re.IGNORECASE)
_URL_WITH_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@]*@")


def mask_url(url: str) -> str:
    """``url`` with its password (and any token-like user part) replaced by ``MASK``; the scheme,
    user name, host, port and path stay, so a log still says where a client connects.

    ``redis://alice:s3cret@host:6379/0`` -> ``redis://alice:**********@host:6379/0``;
    ``https://token@host/`` -> ``https://**********@host/``. Strings that are not URLs with user info
    come back unchanged; so does anything that cannot be parsed, after masking its user-info part.
    """
    if "@" not in url or "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return _URL_WITH_USERINFO.sub(lambda m: m.group(0).split("://")[0] + f"://{MASK}@", url)
    if parts.username is None and parts.password is None:
        return url
    user = parts.username or ""
    userinfo = f"{user}:{MASK}" if parts.password is not None else MASK
    netloc = userinfo + "@" + (f"[{host}]" if host and ":" in host else host or "")
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact(value: Any, key: str = "") -> Any:
    """A JSON-able copy of ``value`` (models, dicts, lists, scalars) with every secret masked."""
    if isinstance(value, SecretStr):
        return MASK if value.get_secret_value() else ""
    if isinstance(value, BaseModel):
        return {name: redact(getattr(value, name), name) for name in type(value).model_fields}
    if isinstance(value, dict):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if key and _SECRET_NAME.search(key) and value:
            return MASK
        return mask_url(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return mask_url(str(value))


def redacted_config_dump(settings: BaseModel | dict[str, Any], *, exclude: set[str] | None = None) -> str:
    """One JSON line of ``settings`` safe to print: what each component logs on start."""
    data = redact(settings)
    if exclude and isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in exclude}
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS).decode()
