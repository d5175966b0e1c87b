"""Both clients send the deadline they wait for. Without a ``deadline_ms`` from the caller they timed out
at their own ``default_deadline_ms`` (plus slack) but sent none, so the service applied its own default:
a longer one answered after the client had given up, the model call made for nobody."""

from __future__ import annotations

import asyncio

from devstack.stack import StackState
from realtime.client import MatchClient, SyncMatchClient
from tests.conftest import Isolated
from tests.realtime.service_kit import realtime_service

# Seconds, not the 300 ms a ranking call gets: admission counts the event loop's lag as the request's
# age, and late in a CI run a collector pause of the test process (258 ms once) refused a 300 ms request.
# What is checked is which of the two the service applied.
CLIENT_DEADLINE_MS = 1500
SERVICE_DEADLINE_MS = 4000
SLACK_MS = 10_000


async def test_both_clients_send_their_default_deadline(stack: StackState, isolated: Isolated) -> None:
    service = realtime_service(
        isolated, stack.llm_endpoints, stack.model, default_deadline_ms=SERVICE_DEADLINE_MS
    )
    async with service as client:
        url = str(client.make_url("/")).rstrip("/")
        # A slack this long, so what is checked is the deadline the service applied, not who gave up.
        async with MatchClient(
            url, default_deadline_ms=CLIENT_DEADLINE_MS, slack_ms=SLACK_MS
        ) as async_client:
            answer = await async_client.match("s1", "", ["a", "b"])
        assert answer.deadline_ms == CLIENT_DEADLINE_MS

        def blocking() -> int:
            with SyncMatchClient(
                url, default_deadline_ms=CLIENT_DEADLINE_MS, slack_ms=SLACK_MS
            ) as sync_client:
                return sync_client.match("s1", "", ["a", "b"]).deadline_ms

        assert await asyncio.to_thread(blocking) == CLIENT_DEADLINE_MS
