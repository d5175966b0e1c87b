"""A body the service cannot read as sent is the caller's error: 400 ``invalid_json``, as the OpenAPI spec
says for a body that is not JSON. It was a 500 ``internal_error`` with a traceback in the log for every
such request (aiohttp raises ``RequestPayloadError`` from ``request.read()``)."""

from __future__ import annotations

import gzip
import logging

import pytest

from devstack.stack import StackState
from realtime.models import ErrorResponse
from tests.conftest import Isolated
from tests.realtime.service_kit import realtime_service

BODY = b'{"shopper_id": "s1", "candidates": ["a"]}'


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_cannot_be_decoded_is_a_400_not_a_500(
    stack: StackState, isolated: Isolated, caplog: pytest.LogCaptureFixture, encoding: str
) -> None:
    async with realtime_service(isolated, stack.llm_endpoints, stack.model) as client:
        # aiohttp closes a connection whose body it could not read: not one for the next request.
        headers = {"Content-Type": "application/json", "Content-Encoding": encoding, "Connection": "close"}
        response = await client.post("/v1/match", data=BODY, headers=headers)  # not compressed
        assert response.status == 400, await response.text()
        error = ErrorResponse.model_validate(await response.json())
        assert error.error.type == "invalid_json" and "could not be read" in error.error.message
        assert "\n" not in error.error.message
        metrics = await (await client.get("/metrics")).text()
        assert 'realtime_rejected_total{type="invalid_json"} 1.0' in metrics

        good = await client.post(
            "/v1/match",
            data=gzip.compress(BODY),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
        assert good.status == 200, await good.text()  # a body sent compressed as it says is read
    ours = [r for r in caplog.records if r.name.startswith("realtime") and r.levelno >= logging.ERROR]
    assert not ours, "no traceback for a bad body"
