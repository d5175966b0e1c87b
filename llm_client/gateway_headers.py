"""What a gateway in front of the replicas says about them in its answers' headers.

A client that calls a gateway (``shopper router serve``) instead of the replicas still needs to know
which replica served each answer (an insight names it, and affinity is judged by it) and how many
replicas stand behind the one address (the admission limit is sized per replica). The gateway writes
both on every answer; this client reads them (``llm_client.exchange``). A replica sends neither, so
an endpoint without them is one replica.
"""

from __future__ import annotations

from collections.abc import Mapping

SERVED_BY_HEADER = "x-gateway-replica"
"""The replica that answered, by the gateway's name for it."""

FLEET_SIZE_HEADER = "x-gateway-routable-replicas"
"""How many replicas the gateway could route to when it answered."""

SUPERSEDED_BY_HEADER = "x-gateway-superseded-by"
"""On a 409: the newer session version that superseded the call (``errors.SupersededByNewer``)."""


def fleet_size(headers: Mapping[str, str]) -> int | None:
    """The replicas behind the endpoint that answered with ``headers``; None when it did not say."""
    raw = headers.get(FLEET_SIZE_HEADER)
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return None
