"""A replica's error status, read as untrusted input, as one of the client's errors.

At most ``ERROR_BODY_MAX_BYTES`` of an error body are read and 300 characters of it kept in the error: a
replica's error page is as untrusted as its answers. The error's type can follow a long message (a KV
pull's connection error), so the whole bounded body is searched for it.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import time

import aiohttp

from llm_client.endpoints import Endpoint
from llm_client.errors import BadRequest, EndpointUnavailable, KvCacheGone, Overloaded, SupersededByNewer
from llm_client.gateway_headers import SUPERSEDED_BY_HEADER

ERROR_BODY_MAX_BYTES = 4096
_UTC = datetime.UTC
KV_CACHE_GONE = "kv_cache_gone"
"""The error type a generation server answers when it could not pull the context server's blocks."""

KV_GONE_STATUSES = frozenset({404, 409})
"""A ``generation_only`` request answered with these: the context server's blocks were not there to pull
(released after the transfer timeout, or the server restarted); the request is prefilled locally."""


async def raise_for_status(response: aiohttp.ClientResponse, endpoint: Endpoint) -> None:
    """Raise the error a status of 400 or more stands for: ``KvCacheGone`` (a P/D hand-over whose blocks
    were gone), ``Overloaded`` (429) or ``EndpointUnavailable`` (5xx), both retryable and with the
    server's ``Retry-After`` on a 429 or 503, ``SupersededByNewer`` (a gateway's 409 for a session it
    saw a newer version of), or ``BadRequest`` (any other 4xx)."""
    body = (await response.content.read(ERROR_BODY_MAX_BYTES)).decode("utf-8", "replace")
    detail = body[:300]
    if response.status in (404, 409, 503) and KV_CACHE_GONE in body:
        raise KvCacheGone(f"HTTP {response.status}: {detail}", endpoint=endpoint.name)
    if response.status == 429 or response.status >= 500:
        wait_s = retry_after_s(response.headers.get("Retry-After")) if response.status in (429, 503) else None
        error = Overloaded if response.status == 429 else EndpointUnavailable
        raise error(f"HTTP {response.status}: {detail}", endpoint=endpoint.name, retry_after_s=wait_s)
    newer = response.headers.get(SUPERSEDED_BY_HEADER)
    if response.status == 409 and newer is not None:
        raise SupersededByNewer(f"HTTP 409: {detail}", newer_version=newer, endpoint=endpoint.name)
    raise BadRequest(f"HTTP {response.status}: {detail}", endpoint=endpoint.name)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks the client to wait (RFC 9110, section 10.2.3): a number
    of seconds (a fraction accepted too), or an HTTP date (a date already past is 0). None when the
    header is absent or unreadable: the client's own backoff applies then."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
            # RFC 9110 dates are GMT; parsedate_to_datetime leaves '-0000' naive (UTC all the same).
            stamp = when.timestamp() if when.tzinfo is not None else when.replace(tzinfo=_UTC).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):  # a year past any date: OverflowError
            return None
        return max(0.0, stamp - (time.time() if now is None else now))
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
