"""Redis AUTH (an ACL user and the default user's password) and TLS (``rediss://``), against a
TLS-only ``redis-server`` the test starts with a CA it generates: the sinks' settings reach every
client (asyncio and blocking), wrong credentials and an untrusted server fail loudly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from pydantic import SecretStr, ValidationError
from redis.exceptions import AuthenticationError, ConnectionError

from pipeline.redaction import redacted_config_dump
from prompt_assembly.records import ShopperInsight, Usage
from prompt_assembly.understanding import ShopperUnderstanding
from sinks.config import SinkSettings
from sinks.redis import RedisSignalSink
from tests.security_kit import TestCertificates, make_certificates, tls_redis

DEFAULT_PASSWORD = "default-Pw-1"
USER, USER_PASSWORD = "signals-writer", "p@ss:w/rd%20 é"  # every character a URL must escape


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, TestCertificates]]:
    directory = tmp_path_factory.mktemp("redis-tls")
    certs = make_certificates(directory)
    with tls_redis(directory, certs, DEFAULT_PASSWORD, user=USER, user_password=USER_PASSWORD) as port:
        yield port, certs


def _insight(seq: int) -> ShopperInsight:
    understanding = ShopperUnderstanding(
        interests=["witch costumes"], occasion=None, style="fun", price_sensitivity="medium", summary="s"
    )
    return ShopperInsight(
        request_id=f"s1:{seq}", shopper_id="s1", seq=seq, reason="add_to_cart", understanding=understanding,
        text="t", model="m", replica="r", usage=Usage(), event_count=1, last_event_ts=time.time(),
        ttft_ms=1, latency_ms=1, attempts=1, produced_at=time.time(),
    )  # fmt: skip


async def test_signal_sink_writes_over_tls_as_an_acl_user(server: tuple[int, TestCertificates]) -> None:
    port, certs = server
    url = f"rediss://{USER}:{quote(USER_PASSWORD, safe='')}@127.0.0.1:{port}/0"
    settings = SinkSettings(redis_url=url, redis_ca_file=certs.ca, redis_key_prefix="sec:")
    assert settings.redis_url == f"rediss://127.0.0.1:{port}/0", "the URL keeps no credentials"
    assert settings.redis_username == USER
    assert settings.redis_password == SecretStr(USER_PASSWORD)
    sink = RedisSignalSink(settings)
    try:
        await sink.write([_insight(1)])
        assert (await sink.read("s1"))["interests"] == '["witch costumes"]'
        assert await sink.redis.acl_whoami() == USER
    finally:
        await sink.close()
    with settings.sync_redis_client() as client:  # the blocking client (Flink's helpers) alike
        assert client.acl_whoami() == USER


async def test_a_password_in_the_url_query_is_moved_out_like_one_in_the_user_info(
    server: tuple[int, TestCertificates],
) -> None:
    """redis-py reads ``?password=`` (and ``?username=``) as the AUTH credentials: they leave the URL
    for the typed fields as ``user:password@`` does, the client still authenticates, and the dump
    masks them. Before, the query kept the password in ``redis_url``, printed in clear."""
    port, certs = server
    for query, user in (
        (f"health_check_interval=5&password={DEFAULT_PASSWORD}", "default"),
        (f"username={USER}&password={quote(quote(USER_PASSWORD, safe=''), safe='')}", USER),
    ):  # redis-py decodes a query value twice (parse_qs, then unquote): so do the settings
        settings = SinkSettings(redis_url=f"rediss://127.0.0.1:{port}/0?{query}", redis_ca_file=certs.ca)
        assert "password" not in settings.redis_url and "username" not in settings.redis_url
        assert settings.redis_password is not None
        client = settings.redis_client()
        try:
            assert await client.acl_whoami() == user
        finally:
            await client.aclose()
        assert settings.redis_password.get_secret_value() not in redacted_config_dump(settings)
    assert settings.redis_url == f"rediss://127.0.0.1:{port}/0"
    with pytest.raises(ValidationError, match="password twice"):
        SinkSettings(redis_url="redis://:a@h:1/0?password=b")
    with pytest.raises(ValidationError, match="both in redis_url and in redis_password"):
        SinkSettings(redis_url="redis://h:1/0?password=a", redis_password=SecretStr("b"))


async def test_default_user_password_as_a_separate_secret(server: tuple[int, TestCertificates]) -> None:
    port, certs = server
    settings = SinkSettings(
        redis_url=f"rediss://127.0.0.1:{port}/0",
        redis_password=SecretStr(DEFAULT_PASSWORD),
        redis_ca_file=certs.ca,
    )
    client = settings.redis_client()
    try:
        assert await client.ping() is True
        assert await client.acl_whoami() == "default"
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("credentials", "error"),
    [
        (f"{USER}:wrong", AuthenticationError),
        (":wrong", AuthenticationError),
        ("", AuthenticationError),  # NOAUTH on the first command
    ],
)
async def test_wrong_or_missing_credentials_are_refused(
    server: tuple[int, TestCertificates], credentials: str, error: type[Exception]
) -> None:
    port, certs = server
    at = f"{credentials}@" if credentials else ""
    client = SinkSettings(redis_url=f"rediss://{at}127.0.0.1:{port}/0", redis_ca_file=certs.ca).redis_client()
    try:
        with pytest.raises(error):
            await client.set("sec:x", "1")
    finally:
        await client.aclose()


async def test_untrusted_or_plaintext_connections_fail(
    server: tuple[int, TestCertificates], tmp_path: Path
) -> None:
    port, _ = server
    url = f"rediss://:{DEFAULT_PASSWORD}@127.0.0.1:{port}/0"
    other_ca = make_certificates(tmp_path / "other").ca  # a CA that did not sign the server
    for settings in (SinkSettings(redis_url=url), SinkSettings(redis_url=url, redis_ca_file=other_ca)):
        client = settings.redis_client(socket_timeout=5)
        try:
            with pytest.raises(ConnectionError, match="certificate verify failed"):
                await client.ping()
        finally:
            await client.aclose()
    plaintext = SinkSettings(redis_url=f"redis://:{DEFAULT_PASSWORD}@127.0.0.1:{port}/0").redis_client(
        socket_timeout=3
    )
    try:
        with pytest.raises(ConnectionError):
            await plaintext.ping()
    finally:
        await plaintext.aclose()


def test_settings_refuse_two_passwords_and_missing_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match="both in redis_url and in redis_password"):
        SinkSettings(redis_url="redis://:a@h:1/0", redis_password=SecretStr("b"))
    with pytest.raises(ValidationError):
        SinkSettings(redis_ca_file=tmp_path / "missing.crt")
    make_certificates(tmp_path)
    monkeypatch.chdir(tmp_path)
    relative = SinkSettings(redis_ca_file=Path("ca.crt"))
    # redis-py fails with a relative CA path: the client always gets an absolute one.
    assert Path(relative.redis_connection_kwargs()["ssl_ca_certs"]).is_absolute()
