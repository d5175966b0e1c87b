"""LLM endpoints over HTTPS with a private CA, and with a bearer API key, against the real simulator:
TLS by a socat terminator in front of it (the CA is the test's own), the key checked by a small aiohttp
gateway in front of it that refuses requests without the right ``Authorization`` header."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llm_client.client import LLMClient
from llm_client.config import ClientConfig
from llm_client.errors import LLMError
from llm_client.transport import EndpointSecurity, header_value
from serving.simulator.testing import running_simulator
from tests.security_kit import make_certificates, tls_terminator

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Shopper s1: activity log, oldest first.\nTask: describe."}]


def _config(url: str, **security: object) -> ClientConfig:
    return ClientConfig(
        endpoints=[url],
        model="m",
        stream=False,
        retry={"max_attempts": 1},
        timeouts={"connect_s": 2.0, "attempt_s": 5.0, "deadline_s": 5.0},
        security=EndpointSecurity.model_validate(security),
    )


async def test_https_endpoint_with_a_private_ca(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    async with running_simulator(time_scale=0.001) as sim:
        port = int(sim.url.rsplit(":", 1)[1])
        with tls_terminator(tmp_path, certs, port) as tls_port:
            url = f"https://127.0.0.1:{tls_port}"
            async with LLMClient(_config(url, ca_file=certs.ca)) as client:
                completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=16)
                assert completion.text and completion.endpoint == f"127.0.0.1:{tls_port}"
            # The same endpoint without the CA: the certificate is not trusted, no answer.
            async with LLMClient(_config(url)) as client:
                with pytest.raises(LLMError):
                    await client.chat(MESSAGES, routing_key="s1", max_tokens=16, deadline_s=3.0)


@asynccontextmanager
async def _gateway_requiring(key: str, upstream: str) -> AsyncIterator[tuple[str, list[str]]]:
    """An aiohttp reverse proxy that answers 401 unless ``Authorization: Bearer <key>``; records the
    headers it saw (without the key) so the test can say what arrived."""
    seen: list[str] = []

    async def forward(request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        seen.append("bearer" if header.startswith("Bearer ") else "missing")
        if not hmac.compare_digest(header.encode(), f"Bearer {key}".encode()):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, upstream + request.path, data=await request.read()) as answer,
        ):
            return web.Response(
                body=await answer.read(), status=answer.status, content_type="application/json"
            )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_bearer_api_key_reaches_the_endpoint() -> None:
    key = "sk-test-0123456789abcdef"
    async with running_simulator(time_scale=0.001) as sim, _gateway_requiring(key, sim.url) as (url, seen):
        async with LLMClient(_config(url, api_key=key)) as client:
            completion = await client.chat(MESSAGES, routing_key="s1", max_tokens=16)
            assert completion.text
        assert "bearer" in seen
        async with LLMClient(_config(url, api_key="sk-wrong")) as client:
            with pytest.raises(LLMError):
                await client.chat(MESSAGES, routing_key="s1", max_tokens=16, deadline_s=3.0)
        async with LLMClient(_config(url)) as client:
            with pytest.raises(LLMError):
                await client.chat(MESSAGES, routing_key="s1", max_tokens=16, deadline_s=3.0)
        assert "missing" in seen


def test_api_key_is_a_secret_in_the_printed_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.redaction import redacted_config_dump

    monkeypatch.setenv("LLM_SECURITY__API_KEY", "sk-env-secret-42")
    config = ClientConfig()
    assert config.security.api_key is not None
    assert config.security.api_key.get_secret_value() == "sk-env-secret-42"
    assert "sk-env-secret-42" not in redacted_config_dump(config)
    assert "sk-env-secret-42" not in repr(config) and "sk-env-secret-42" not in config.model_dump_json()


async def test_shopper_ids_with_control_characters_reach_the_endpoint() -> None:
    """Found by the real-time API fuzzer: a shopper id with a control character went into the
    ``x-session-id`` header, aiohttp refused it with a ValueError (not an LLMError), and the call
    failed with a 500 in the real-time API, an exception out of the runner's enricher. Now every id
    is sent percent-encoded and the call completes."""
    hostile = [f"s{chr(c)}1" for c in [*range(0, 32), 127]] + ["s\r\nX-Injected: 1", "ü\u202e%41", "%41"]
    async with running_simulator(time_scale=0.001) as sim, LLMClient(_config(sim.url)) as client:
        for key in hostile:
            completion = await client.chat(MESSAGES, routing_key=key, max_tokens=4)
            assert completion.text
    encoded = [header_value(k) for k in hostile]
    assert len(set(encoded)) == len(hostile), "distinct ids stay distinct"
    assert all(all(0x20 <= ord(ch) < 0x7F for ch in value) for value in encoded)
    assert header_value("shopper-42_a.b") == "shopper-42_a.b", "ordinary ids are unchanged"
