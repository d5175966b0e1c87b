"""Printing configuration and output without their secrets.

Every component prints its settings on start (STYLE.md), and those settings hold passwords, API keys
and URLs that may carry credentials. ``redacted_config_dump`` is what they print instead of
``model_dump_json``: ``SecretStr`` fields come out as ``"**********"``, any field whose name says it is a
secret is masked whatever its type, and every string that is a URL with a password keeps its host but
loses the password (``mask_url``), in its user info or in a query parameter such as ``?password=``.
The result is meant for logs; it is not a way to save settings.

``RedactingStream`` is the net under all of that for a whole command: ``shopper`` writes its stdout and
stderr through it, so whatever a command prints (its own lines, a library's log, a traceback) goes
through ``mask_text`` (URL passwords anywhere in the text) and has every secret value given to it (those
the environment holds: ``secrets_in_environment``) replaced by ``MASK``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import Any, TextIO
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import orjson
from pydantic import BaseModel, SecretStr

MASK = "**********"

_SECRET_NAME = re.compile(r"(password|passwd|secret|token|api_?key|credential|jaas)", re.IGNORECASE)
_URL_WITH_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@]*@")

_SECRET_QUERY_NAME = (
    r"[A-Za-z0-9_.-]*(?:password|passwd|pwd|secret|token|api_?key|credential|signature)[A-Za-z0-9_.-]*"
)
_SECRET_QUERY_PARAM = re.compile(rf"(?P<name>(?:^|(?<=[?&;])){_SECRET_QUERY_NAME}=)(?P<value>[^&;#]*)", re.I)
"""``name=value`` in a URL's query string whose name says it is a secret (``password``, ``auth_token``,
``api_key``, ``X-Amz-Signature``, ...); redis-py, for one, takes ``?password=`` as the AUTH password."""

_TEXT_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#@\"'<>\[\]]+)@")
_TEXT_SECRET_QUERY = re.compile(rf"(?P<name>[?&;]{_SECRET_QUERY_NAME}=)(?P<value>[^&;#\s\"'<>]+)", re.I)

_SECRET_ENV_WORDS = frozenset(
    {"PASSWORD", "PASSWD", "SECRET", "TOKEN", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
)
MIN_SECRET_CHARS = 4
"""Values shorter than this are not searched for in output (masking every ``abc`` would garble it);
they are still masked wherever they are printed as a setting."""


def mask_url(url: str) -> str:
    """``url`` with its password (and any token-like user part) replaced by ``MASK``; the scheme,
    user name, host, port and path stay, so a log still says where a client connects. A query parameter
    whose name says it is a secret (``?password=``, ``?token=``) is masked the same way.

    ``redis://alice:s3cret@host:6379/0`` -> ``redis://alice:**********@host:6379/0``;
    ``https://token@host/`` -> ``https://**********@host/``;
    ``redis://host:6379/0?password=s3cret`` -> ``redis://host:6379/0?password=**********``. Strings
    that are not URLs with user info or secret query parameters come back unchanged; so does anything
    that cannot be parsed, after masking its user-info part and secret query parameters.
    """
    if "://" not in url or ("@" not in url and "=" not in url):
        return url
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return mask_text(url)
    query = _mask_query(parts.query)
    if parts.username is None and parts.password is None:
        if query == parts.query:
            return url
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))
    user = parts.username or ""
    userinfo = f"{user}:{MASK}" if parts.password is not None else MASK
    netloc = userinfo + "@" + (f"[{host}]" if host and ":" in host else host or "")
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _mask_query(query: str) -> str:
    return _SECRET_QUERY_PARAM.sub(lambda m: m.group("name") + (MASK if m.group("value") else ""), query)


def mask_text(text: str) -> str:
    """``text`` (a log line, an exception message, JSON) with every URL's user-info password and every
    secret-named query parameter masked, wherever in the text the URL stands."""
    if "://" in text and "@" in text:
        text = _TEXT_USERINFO.sub(_masked_userinfo, text)
    if "=" in text:
        text = _TEXT_SECRET_QUERY.sub(lambda m: m.group("name") + MASK, text)
    return text


def _masked_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match.group("userinfo").partition(":")
    return match.group("scheme") + (f"{user}:{MASK}" if colon else MASK) + "@"


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


def secrets_in_environment(environ: Mapping[str, str]) -> set[str]:
    """The secret values an environment holds, to search for in output: the value of every variable
    whose name says it is a secret (``..._PASSWORD``, ``..._SECRET_ACCESS_KEY``, ``..._API_KEY(S)``,
    ``..._TOKEN``; each item too when it is a JSON list), and in every variable, the password of every
    URL and every secret-named query parameter (``redis://:pw@host``, ``...?password=pw``)."""
    found: set[str] = set()
    for name, value in environ.items():
        if not value:
            continue
        if _secret_env_name(name):
            found.add(value)
            found.update(_json_strings(value))
        for match in _TEXT_USERINFO.finditer(value):
            user, colon, password = match.group("userinfo").partition(":")
            found.add(password if colon else user)
        for match in _TEXT_SECRET_QUERY.finditer(value):
            found.add(match.group("value"))
    plain = {unquote(s) for s in found} | found
    return {s for s in plain if len(s) >= MIN_SECRET_CHARS and not _is_plain_setting(s)}


def _secret_env_name(name: str) -> bool:
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w]
    pairs = {a + b for a, b in pairwise(words)}
    return bool(_SECRET_ENV_WORDS.intersection(words) or {"APIKEY", "APIKEYS", "JAASCONFIG"} & pairs)


def _json_strings(value: str) -> list[str]:
    if not value.startswith("["):
        return []
    try:
        items = json.loads(value)
    except ValueError:
        return []
    return [item for item in items if isinstance(item, str)] if isinstance(items, list) else []


def _is_plain_setting(value: str) -> bool:
    """Numbers and booleans are not secrets, even under a secret-sounding name (``..._TOKEN_LIMIT=4096``)."""
    if value.lower() in {"true", "false", "none", "null", "yes", "no", "on", "off"}:
        return True
    try:
        float(value)
    except ValueError:
        return False
    return True


class RedactingStream:
    """A text stream that passes to ``target`` what ``mask_text`` leaves of each line, with every
    string of ``secrets`` (and its URL-quoted and JSON-escaped spellings) replaced by ``MASK``.

    Whole lines are masked (a secret split over two ``write`` calls, as ``print(a, b)`` makes, is still
    found); a partial line goes out on ``flush``. Anything else (``isatty``, ``fileno``, ``encoding``)
    is the target's. The binary ``buffer`` is hidden, so a writer that looks for it (click does, for a
    misconfigured encoding) writes through this stream rather than around it.
    """

    def __init__(self, target: TextIO, secrets: Iterable[str] = ()) -> None:
        self.target = target
        spellings: set[str] = set()
        for secret in secrets:
            if len(secret) >= MIN_SECRET_CHARS:
                spellings |= {secret, quote(secret, safe=""), json.dumps(secret)[1:-1]}
        self._secrets = sorted(spellings, key=len, reverse=True)  # longest first: no partial leftovers
        self._pending = ""

    def mask(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return mask_text(text)

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._pending += text
        cut = self._pending.rfind("\n") + 1
        if cut:
            self.target.write(self.mask(self._pending[:cut]))
            self._pending = self._pending[cut:]
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self.target.write(self.mask(self._pending))
            self._pending = ""
        self.target.flush()

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":
            raise AttributeError(name)
        return getattr(self.target, name)
