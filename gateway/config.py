"""Gateway settings: one pydantic-settings model (env prefix ``GATEWAY_``), printed on start.

The replicas, routing policy, retries, timeouts and health checks are the LLM client's own settings
(``llm_client.config.ClientConfig``, env prefix ``LLM_``): the gateway adds only what belongs to the
HTTP face in front of them.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prompt_assembly.errors import ConfigurationError


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_")

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535, description="0 picks a free port (printed in the READY line)")
    shopper_key_header: str = Field(
        "x-session-id", description="header carrying the routing key; the body's `user` field is the fallback"
    )
    default_max_tokens: int = Field(
        200, ge=1, description="decode budget assumed for load accounting when a request sets no max_tokens"
    )
    max_body_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="largest request body accepted; larger ones get 413 before they are read (a chat "
        "request of 4k prompt tokens is about 20 KB)",
    )
    offload_body_bytes: int = Field(
        32 * 1024,
        ge=0,
        description="bodies of at least this size are parsed and hashed for routing in a worker thread, "
        "not on the event loop (about 1 ms of loop time per 25 KB when done inline)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="callers must send 'Authorization: Bearer <key>'; None = no authentication "
        "(GATEWAY_API_KEY)",
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="the operators' credential for /admin routes ('Authorization: Bearer <key>'), "
        "apart from the callers' key; None = the admin routes answer 403 (GATEWAY_ADMIN_API_KEY)",
    )
    public_paths: tuple[str, ...] = Field(
        ("/health", "/metrics"), description="paths served without the key (probes, scrapes)"
    )
    reuse_port: bool = Field(
        False,
        description="SO_REUSEPORT: several gateway processes listen on one port and the kernel spreads "
        "connections over them (one process per core; each keeps its own view of the replicas' load)",
    )
    deadline_s: float | None = Field(
        None, gt=0, description="whole request, retries and streaming included; default: LLM timeouts"
    )

    @model_validator(mode="after")
    def _admin_key_is_its_own(self) -> GatewaySettings:
        if (
            self.admin_api_key is not None
            and self.api_key is not None
            and self.admin_api_key.get_secret_value() == self.api_key.get_secret_value()
        ):
            raise ConfigurationError(
                "GATEWAY_ADMIN_API_KEY equals GATEWAY_API_KEY: every caller could change the routing; "
                "give the admin routes a key of their own"
            )
        return self
