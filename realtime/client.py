"""The lightweight client ad servers embed: ``MatchClient`` (asyncio, aiohttp) and ``SyncMatchClient``
(standard library only, one keep-alive connection, for threaded servers).

Both send ``POST /v1/match`` (with ``api_key``, when given, as ``X-API-Key``) and return a
``MatchResponse``; a degraded answer is still an answer (check ``response.degraded``). A 4xx other than
429 raises ``MatchRejected`` with the service's error body (do not retry it); no answer within the
transport timeout (deadline plus ``slack_ms``), or a 200 that is not a ``MatchResponse``, raises
``MatchUnavailable`` (fall back to the ad server's own ranking), and so does a 429: a refusal by
deadline-aware admission (``overloaded``: ``MatchOverloaded``) or by the rate limit (``rate_limited``:
``MatchRateLimited``), with the ``Retry-After`` to send less for.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from prompt_assembly.errors import ConfigurationError, ShopperError
from realtime.models import Candidate, ErrorResponse, MatchResponse

CandidateLike = Candidate | str | dict[str, Any]


class MatchClientError(ShopperError):
    """Base class of the client's errors."""


class MatchRejected(MatchClientError):
    """The service refused the request (4xx but 429): fix the request, do not retry it."""

    def __init__(self, status: int, error: ErrorResponse | None, raw: bytes) -> None:
        message = error.error.message if error else raw[:200].decode(errors="replace")
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.error = error


class MatchUnavailable(MatchClientError):
    """No usable answer in time (connection failed, timed out, 5xx, a 200 that is not an answer, or a
    429)."""


class MatchOverloaded(MatchUnavailable):
    """The service could not answer within the deadline and refused at once (429 ``overloaded``):
    use the ad server's own ranking, and send less for ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MatchRateLimited(MatchOverloaded):
    """This client sent more than its rate (429 ``rate_limited``): the same contract as a refusal by
    admission, so a ``MatchOverloaded`` (a caller backing off on one backs off on the other); it was
    a ``MatchRejected``, which said never to retry a request that only came too soon."""


def _body(shopper_id: str, query: str, candidates: Sequence[CandidateLike], deadline_ms: int) -> bytes:
    """The request, with the deadline the client waits for: the service's own default may be longer,
    and it answered after the client had given up."""
    items = [c.model_dump(exclude_none=True) if isinstance(c, Candidate) else c for c in candidates]
    payload = {"shopper_id": shopper_id, "query": query, "candidates": items, "deadline_ms": deadline_ms}
    return orjson.dumps(payload)


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["X-API-Key"] = api_key
    return headers


def _parse(status: int, raw: bytes, retry_after: str | None = None) -> MatchResponse:
    if status == 200:
        try:
            return MatchResponse.model_validate_json(raw)
        except ValueError:  # pydantic's ValidationError: not an error the caller is told to expect
            text = raw[:200].decode(errors="replace")
            raise MatchUnavailable(f"HTTP 200 that is not a match answer: {text}") from None
    if 400 <= status < 500:
        try:
            error = ErrorResponse.model_validate_json(raw)
        except ValueError:
            error = None
        if status == 429:  # a refusal to come back from, whichever its type: never MatchRejected
            message = f"HTTP {status}: {error.error.message if error else raw[:200].decode(errors='replace')}"
            if error is not None and error.error.type == "overloaded":
                raise MatchOverloaded(message, _seconds(retry_after))
            raise MatchRateLimited(message, _seconds(retry_after))
        raise MatchRejected(status, error, raw)
    raise MatchUnavailable(f"HTTP {status}: {raw[:200].decode(errors='replace')}")


def _seconds(retry_after: str | None) -> float:
    try:
        return max(float(retry_after or 1), 1.0)
    except ValueError:
        return 1.0


class MatchClient:
    """Async client; share one per process (it pools connections). ``api_key``: for a service with
    ``REALTIME_API_KEYS`` set, which answers 401 without one."""

    def __init__(
        self,
        base_url: str,
        *,
        default_deadline_ms: int = 300,
        slack_ms: int = 50,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.default_deadline_ms = default_deadline_ms
        self.slack_ms = slack_ms
        self._headers = _headers(api_key)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> MatchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _session_or_new(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def match(
        self,
        shopper_id: str,
        query: str,
        candidates: Sequence[CandidateLike],
        *,
        deadline_ms: int | None = None,
    ) -> MatchResponse:
        deadline_ms = deadline_ms or self.default_deadline_ms
        timeout = (deadline_ms + self.slack_ms) / 1000
        try:
            async with self._session_or_new().post(
                self.base_url + "/v1/match",
                data=_body(shopper_id, query, candidates, deadline_ms),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                raw = await response.read()
                status = response.status
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MatchUnavailable(f"no answer from {self.base_url}: {exc!r}") from None
        return _parse(status, raw, retry_after)


class SyncMatchClient:
    """Blocking client over one keep-alive connection; not thread-safe (use one per thread).
    ``api_key`` as for ``MatchClient``."""

    def __init__(
        self,
        base_url: str,
        *,
        default_deadline_ms: int = 300,
        slack_ms: int = 50,
        api_key: str | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigurationError(f"{base_url!r}: expected http://host:port")
        self.host, self.port = parts.hostname, parts.port or 80
        self.default_deadline_ms = default_deadline_ms
        self.slack_ms = slack_ms
        self._headers = _headers(api_key)
        self._conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> SyncMatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def match(
        self,
        shopper_id: str,
        query: str,
        candidates: Sequence[CandidateLike],
        *,
        deadline_ms: int | None = None,
    ) -> MatchResponse:
        deadline_ms = deadline_ms or self.default_deadline_ms
        timeout = (deadline_ms + self.slack_ms) / 1000
        give_up_at = time.monotonic() + timeout
        body = _body(shopper_id, query, candidates, deadline_ms)
        for attempt in range(2):  # a kept-alive connection the server closed is reopened once
            left = give_up_at - time.monotonic()
            if left <= 0:
                raise MatchUnavailable(
                    f"no answer from {self.host}:{self.port} within {timeout * 1000:.0f} ms"
                )
            reused = self._conn is not None and self._conn.sock is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=left)
            self._conn.timeout = left
            if self._conn.sock is not None:
                self._conn.sock.settimeout(left)
            try:
                self._conn.request("POST", "/v1/match", body=body, headers=self._headers)
                response = self._conn.getresponse()
                raw = response.read()
                return _parse(response.status, raw, response.getheader("Retry-After"))
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                # Only a kept-alive connection the server had closed is worth one more try, and only
                # within the time left: a request dropped on a new connection (the service died under
                # it) sent again answered long past deadline + slack.
                if attempt == 1 or not reused:
                    raise MatchUnavailable(f"connection to {self.host}:{self.port} dropped") from None
            except (TimeoutError, OSError, http.client.HTTPException) as exc:
                self.close()
                raise MatchUnavailable(f"no answer from {self.host}:{self.port}: {exc!r}") from None
        raise MatchUnavailable("unreachable")  # pragma: no cover
