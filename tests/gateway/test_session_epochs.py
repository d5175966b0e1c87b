"""At the gateway, only a later version of the same session supersedes a call. After a shopper's
state was lost, the new session's epoch (the event time of its first event) is smaller than the lost
one's when that event came late (``docs/contracts.md``, "Versions"): ordered by epoch, every call of
the new session was refused 409 for as long as the gateway remembered the lost session's version.
Against a real gateway in front of a real simulator replica."""

from __future__ import annotations

import uuid

import aiohttp

from tests.gateway.test_gateway import chat_body, metric, running_gateway, scrape
from tests.gateway.test_overload import SHORT, post, replica, session_headers

__all__ = ["replica"]  # the module-scoped simulator fixture, shared with test_overload


async def test_a_new_session_with_a_smaller_epoch_is_answered_and_older_versions_of_it_are_not(
    http: aiohttp.ClientSession, replica: str
) -> None:
    shopper = f"s-{uuid.uuid4().hex[:8]}"
    async with running_gateway([replica], "round_robin") as gw:
        lost = await post(
            http, gw.url, chat_body("lost session", **SHORT), **session_headers(shopper, "9000.3")
        )
        assert lost[0] == 200
        # The new session, started after the state loss by a late event: a smaller epoch.
        status, _, _ = await post(
            http, gw.url, chat_body("new session", **SHORT), **session_headers(shopper, "5000.2")
        )
        assert status == 200
        # Within that session the rule is unchanged: an older version is superseded on arrival.
        status, headers, body = await post(
            http, gw.url, chat_body("new session, replayed", **SHORT), **session_headers(shopper, "5000.1")
        )
        assert (status, body["error"]["type"], headers["x-gateway-superseded-by"]) == (
            409,
            "superseded",
            "5000.2",
        )
        assert metric(await scrape(http, gw.url), "gateway_superseded_total", stage="arrival") == 1
