"""The real-time API's guards over HTTP: API keys (401), body size (413), per-client rate limit (429),
every refusal a JSON error. The service runs against a simulator replica and a TLS-only Redis with an
ACL user (started by the test), so its Redis client's credentials and CA are exercised too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from realtime.auth import ApiKeyAuthenticator, presented_key
from realtime.config import RealtimeSettings
from realtime.rate_limit import ClientRateLimiter, TokenBucket, retry_after_header
from realtime.service import create_app, realtime_client_config
from serving.simulator.testing import running_simulator
from sinks.config import SinkSettings
from tests.security_kit import make_certificates, tls_redis

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
BODY = {"shopper_id": "s1", "query": "witch", "candidates": ["KID-witch", "MAK-paint"], "deadline_ms": 2000}


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("redis-tls")
    certs = make_certificates(directory)
    with tls_redis(directory, certs, "default-pw", user="realtime", user_password="realtime-pw") as port:
        yield SinkSettings(
            redis_url=f"rediss://realtime:realtime-pw@127.0.0.1:{port}/0",
            redis_ca_file=certs.ca,
            redis_key_prefix="guards:",
        )


@asynccontextmanager
async def _service(sinks: SinkSettings, **settings: Any) -> AsyncIterator[TestClient[Any, Any]]:
    async with running_simulator(time_scale=0.001) as sim:
        app = create_app(
            RealtimeSettings(**settings), llm_config=realtime_client_config([sim.url], "m"), sinks=sinks
        )
        async with TestClient(TestServer(app)) as client:
            yield client


async def _error(response: Any, status: int, error_type: str) -> dict[str, Any]:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    body: dict[str, Any] = await response.json()
    assert body["error"]["type"] == error_type and body["error"]["message"]
    return body


async def test_api_keys_guard_match_but_not_probes(secure_redis: SinkSettings) -> None:
    async with _service(secure_redis, api_keys=[SecretStr(KEY_A), SecretStr(KEY_B)]) as client:
        response = await client.post("/v1/match", json=BODY)
        await _error(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        await _error(
            await client.post("/v1/match", json=BODY, headers={"X-API-Key": "wrong"}), 401, "unauthorized"
        )
        wrong_bearer = {"Authorization": f"Bearer {KEY_A}x"}
        await _error(await client.post("/v1/match", json=BODY, headers=wrong_bearer), 401, "unauthorized")
        # A wrong key never reaches validation: a broken body still gets 401, not 400.
        await _error(
            await client.post("/v1/match", data=b"{", headers={"X-API-Key": "no"}), 401, "unauthorized"
        )

        ok = await client.post("/v1/match", json=BODY, headers={"X-API-Key": KEY_A})
        assert ok.status == 200, await ok.text()
        answer = await ok.json()
        assert answer["signals"] == {"shopper": False, "products": 0}  # Redis answered over TLS, empty
        ok = await client.post("/v1/match", json=BODY, headers={"Authorization": f"bearer {KEY_B}"})
        assert ok.status == 200

        health = await client.get("/health")
        assert health.status == 200 and (await health.json())["redis"] == "ok"  # TLS + ACL user
        assert (await client.get("/openapi.json")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'realtime_rejected_total{type="unauthorized"} 4.0' in metrics


async def test_body_over_the_limit_is_refused_before_and_while_reading(secure_redis: SinkSettings) -> None:
    async with _service(secure_redis, max_body_bytes=4096) as client:
        big = b'{"shopper_id": "s1", "candidates": ["a"], "query": "' + b"x" * 5000 + b'"}'
        body = await _error(
            await client.post("/v1/match", data=big, headers={"Content-Type": "application/json"}),
            413,
            "payload_too_large",
        )
        assert "4096" in body["error"]["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: cut while reading
            for _ in range(10):
                yield b" " * 1000

        await _error(
            await client.post("/v1/match", data=chunks(), headers={"Content-Type": "application/json"}),
            413,
            "payload_too_large",
        )
        small = await client.post("/v1/match", json=BODY)
        assert small.status == 200
        await _error(await client.get("/v1/nothing-here"), 404, "not_found")
        metrics = await (await client.get("/metrics")).text()
    # Both refusals counted, also the one aiohttp made itself while reading (it was not), and the 404.
    assert 'realtime_rejected_total{type="payload_too_large"} 2.0' in metrics
    assert 'realtime_rejected_total{type="not_found"} 1.0' in metrics


async def test_rate_limit_per_key_with_retry_after(secure_redis: SinkSettings) -> None:
    settings = {
        "api_keys": [SecretStr(KEY_A), SecretStr(KEY_B)],
        "rate_limit_per_s": 0.01,  # one token per 100 s: nothing refills during the test
        "rate_limit_burst": 3,
    }
    async with _service(secure_redis, **settings) as client:
        for _ in range(3):
            assert (await client.post("/v1/match", json=BODY, headers={"X-API-Key": KEY_A})).status == 200
        limited = await client.post("/v1/match", json=BODY, headers={"X-API-Key": KEY_A})
        await _error(limited, 429, "rate_limited")
        assert int(limited.headers["Retry-After"]) >= 1
        # Another key has its own bucket.
        assert (await client.post("/v1/match", json=BODY, headers={"X-API-Key": KEY_B})).status == 200
        # Guessing keys is limited by address: three wrong keys, then 429 instead of 401.
        for _ in range(3):
            await _error(
                await client.post("/v1/match", json=BODY, headers={"X-API-Key": "guess"}), 401, "unauthorized"
            )
        await _error(
            await client.post("/v1/match", json=BODY, headers={"X-API-Key": "guess"}), 429, "rate_limited"
        )
        assert (await client.get("/health")).status == 200  # probes are never limited


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    limiter = ClientRateLimiter(rate_per_s=2.0, burst=2, clock=lambda: now[0])
    assert [limiter.retry_after_s("c") for _ in range(2)] == [0.0, 0.0]
    assert limiter.retry_after_s("c") == pytest.approx(0.5)
    now[0] = 0.5
    assert limiter.retry_after_s("c") == 0.0
    now[0] = 100.0  # refills to the burst, not beyond
    assert [limiter.retry_after_s("c") for _ in range(3)][-1] > 0
    assert retry_after_header(0.01) == "1" and retry_after_header(2.2) == "3"
    bucket = TokenBucket(rate_per_s=1.0, burst=1, tokens=0.0, updated=0.0)
    assert bucket.take(0.25) == pytest.approx(0.75)


def test_rate_limiter_memory_is_bounded() -> None:
    limiter = ClientRateLimiter(rate_per_s=1.0, burst=1, max_clients=100, clock=lambda: 0.0)
    for i in range(10_000):
        limiter.retry_after_s(f"addr:{i}")
    assert len(limiter) == 100
    assert not ClientRateLimiter(rate_per_s=0, burst=1).enabled


def test_authenticator_matches_only_configured_keys() -> None:
    auth = ApiKeyAuthenticator([SecretStr(KEY_A)])
    assert auth.required
    client = auth.client_id(KEY_A)
    assert client is not None and client.startswith("key:") and KEY_A not in client
    assert auth.client_id(KEY_A + " ") is None and auth.client_id("") is None and auth.client_id(None) is None
    assert not ApiKeyAuthenticator([]).required and ApiKeyAuthenticator([]).client_id(KEY_A) is None
    assert presented_key(None, " k ") == "k"
    assert presented_key("Bearer  k", None) == "k" and presented_key("Basic k", None) is None


def test_openapi_spec_describes_the_guards() -> None:
    import json

    from realtime.openapi import SPEC_PATH, openapi_spec

    spec = openapi_spec()
    responses = spec["paths"]["/v1/match"]["post"]["responses"]
    assert {"401", "413", "429"} <= responses.keys()
    assert "Retry-After" in responses["429"]["headers"]
    assert set(spec["components"]["securitySchemes"]) == {"ApiKeyHeader", "BearerKey"}
    assert json.loads(Path(SPEC_PATH).read_text()) == json.loads(json.dumps(spec))
