"""Sink settings (env prefix ``SINK_``): which sinks an engine writes (``enabled``, built by
``sinks.registry``) and how each one reaches its store."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from pydantic import Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prompt_assembly.errors import ConfigurationError

SinkName = Literal["redis", "s3", "kafka"]
"""The sinks ``sinks.registry`` can build."""

DEFAULT_INSIGHTS_TOPIC = "shopper-insights"


class SinkSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SINK_", hide_input_in_errors=True)

    enabled: tuple[SinkName, ...] = Field(
        ("redis", "s3", "kafka"),
        description='the sinks every result goes to, in this order (SINK_ENABLED=\'["redis","s3"]\')',
    )
    insights_topic: str = Field(
        DEFAULT_INSIGHTS_TOPIC, min_length=1, description="the kafka sink's topic: results as JSON"
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis:// or rediss:// (TLS); a password in it is moved to redis_password on load, "
        "(user info or ?password=), so the URL itself never holds a secret",
    )
    redis_username: str | None = Field(None, description="ACL user (Redis 6+); None = 'default'")
    redis_password: SecretStr | None = Field(None, description="AUTH password of redis_username")
    redis_ca_file: FilePath | None = Field(
        None, description="PEM CA bundle that signed the server's certificate (rediss://); None = system CAs"
    )
    redis_key_prefix: str = Field("su:", description="namespace for every key this project writes")
    redis_timeout_s: float | None = Field(
        5.0,
        gt=0,
        description="a Redis command or connect with no answer within this fails (redis-py's "
        "TimeoutError), so a server that accepts but stalls is an outage the retry policies and fallbacks "
        "handle, not a wait without end; None = wait forever",
    )
    signal_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="signals expire if a shopper goes quiet")
    signal_errors_max: int = Field(
        32,
        ge=1,
        description="error records kept per shopper (RedisKeys.signal_errors), the newest versions: every "
        "write renews the hash's TTL, so a shopper whose prompts keep failing (a poison prompt, a long "
        "outage) would otherwise grow it without bound; S3 keeps every error",
    )
    answer_ttl_s: int = Field(
        3600,
        gt=0,
        description="how long the answer ledger (pipeline.answer_ledger) keeps a prompt's answer: longer "
        "than a replay reaches back (the commit interval plus a restart), at most the session state's "
        "TTL, after which a replayed session gets new request ids anyway. Past it a replay pays again "
        "for at most one commit interval's answers; the ledger's memory grows with it (docs/sizing.md: "
        "93 GiB at 100k events/s for 1 h)",
    )
    s3_endpoint_url: str | None = Field(None, description="None = AWS; set for MinIO or moto")
    s3_bucket: str = "shopper-understanding"
    s3_prefix: str = "insights"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = Field(None, description="None = the default AWS credential chain")
    s3_secret_access_key: SecretStr | None = None
    s3_max_records: int = Field(5000, ge=1, description="flush when this many records are buffered")
    s3_max_age_s: float = Field(5.0, gt=0, description="flush records older than this")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint_is_a_url(cls, url: str | None) -> str | None:
        if not url:  # empty, as in ``SINK_S3_ENDPOINT_URL=``: not given (AWS's endpoint), as before
            return None
        if (problem := s3_endpoint_problem(url)) is not None:
            raise ConfigurationError(problem)
        return url

    @field_validator("enabled")
    @classmethod
    def _each_sink_once(cls, enabled: tuple[SinkName, ...]) -> tuple[SinkName, ...]:
        repeated = sorted({name for name in enabled if enabled.count(name) > 1})
        if repeated:
            raise ConfigurationError(f"sinks listed twice in enabled: {', '.join(repeated)}")
        return enabled

    @model_validator(mode="after")
    def _credentials_out_of_url(self) -> SinkSettings:
        """Move the credentials out of ``redis_url`` into the typed fields (the password as a
        ``SecretStr``), so printing the settings can never print them: ``user:password@`` and the
        ``?password=`` / ``?username=`` query parameters that redis-py reads as the same thing."""
        parts = urlsplit(self.redis_url)
        kept, from_query = _split_credential_params(parts.query)
        if parts.password is None and parts.username is None and not from_query:
            return self
        passwords = [unquote(parts.password)] if parts.password is not None else []
        passwords += from_query.get("password", [])
        if len(passwords) > 1:
            raise ConfigurationError(
                "redis_url holds its password twice (user info and ?password=, or ?password= repeated)"
            )
        if passwords:
            if self.redis_password is not None:
                raise ConfigurationError("a Redis password is set both in redis_url and in redis_password")
            self.redis_password = SecretStr(passwords[0])
        usernames = [unquote(parts.username)] if parts.username else []
        usernames += from_query.get("username", [])
        if usernames and self.redis_username is None:
            self.redis_username = usernames[0]
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        self.redis_url = urlunsplit((parts.scheme, netloc, parts.path, "&".join(kept), parts.fragment))
        return self

    def redis_connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Redis.from_url(self.redis_url, ...)`` (sync or asyncio): the ACL
        user, the password and, for ``rediss://``, the CA as an absolute path (redis-py needs one)."""
        kwargs: dict[str, Any] = {}
        if self.redis_username is not None:
            kwargs["username"] = self.redis_username
        if self.redis_password is not None:
            kwargs["password"] = self.redis_password.get_secret_value()
        if self.redis_ca_file is not None:
            kwargs["ssl_ca_certs"] = str(Path(self.redis_ca_file).resolve())
        if self.redis_timeout_s is not None:
            # Without these a Redis that accepted the connection and stopped answering (a stalled
            # server, a failover, a dropped route) held every caller for good: the runner's session
            # loads, the answer ledger (and each prompt's admission slot with it), the real-time reads.
            kwargs["socket_timeout"] = self.redis_timeout_s
            kwargs["socket_connect_timeout"] = self.redis_timeout_s
        return kwargs

    def redis_client(self, **options: Any) -> aioredis.Redis:
        """The one way to build an asyncio Redis client from these settings (credentials, TLS and
        timeouts included); ``options`` go to ``Redis.from_url`` as well, over those."""
        client: aioredis.Redis = aioredis.Redis.from_url(
            self.redis_url, **{**self.redis_connection_kwargs(), **options}
        )
        return client

    def sync_redis_client(self, **options: Any) -> redis.Redis:
        """The blocking client, same settings (PyFlink's synchronous helpers, scripts)."""
        client: redis.Redis = redis.Redis.from_url(
            self.redis_url, **{**self.redis_connection_kwargs(), **options}
        )
        return client

    def s3_client_kwargs(self) -> dict[str, str | None]:
        """Keyword arguments for a boto3/aiobotocore S3 client."""
        kwargs: dict[str, str | None] = {"endpoint_url": self.s3_endpoint_url, "region_name": self.s3_region}
        if self.s3_access_key_id is not None:
            kwargs["aws_access_key_id"] = self.s3_access_key_id
            secret = self.s3_secret_access_key
            kwargs["aws_secret_access_key"] = None if secret is None else secret.get_secret_value()
        return kwargs


def s3_endpoint_problem(url: str) -> str | None:
    """Why ``url`` cannot be an S3 endpoint (None: it can), said with the URL, its user info left out. What
    botocore would refuse (``Invalid endpoint``) and what it would take but never reach (another scheme, a
    port that is no number) are refused here, when the settings are read: botocore said so only when the
    first client was made, as a ``ValueError`` traceback, after the stack or the engine had started."""
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

    shown = repr(shown_endpoint(url))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"{shown} is not an S3 endpoint: an http:// or https:// URL is expected"
    if not (is_valid_endpoint_url(url) or is_valid_ipv6_endpoint_url(url)):
        return f"{shown} is not an S3 endpoint: no valid host in it"
    try:
        parts.port  # noqa: B018 (parsing it is the check)
    except ValueError:
        return f"{shown} is not an S3 endpoint: its port is not a number from 0 to 65535"
    return None


def shown_endpoint(url: str | None) -> str:
    """An S3 endpoint for a message: without user info (``user:secret@``), cut at 200 characters; None
    (the default) is AWS's own endpoint for the region."""
    if url is None:
        return "AWS's default endpoint"
    return re.sub(r"^([^/@]*//)?[^/@]*@", r"\1", url)[:200]


_CREDENTIAL_PARAMS = ("password", "username")


def _split_credential_params(query: str) -> tuple[list[str], dict[str, list[str]]]:
    """A Redis URL's query split into the pieces kept as they are and the credential parameters,
    decoded as redis-py decodes them (``parse_qs``, then ``unquote`` once more)."""
    kept: list[str] = []
    moved: dict[str, list[str]] = {}
    for piece in query.split("&") if query else []:
        name, _, raw = piece.partition("=")
        if unquote_plus(name) in _CREDENTIAL_PARAMS:
            moved.setdefault(unquote_plus(name), []).append(unquote(unquote_plus(raw)))
        else:
            kept.append(piece)
    return kept, moved
