"""Gateway settings: one pydantic-settings model (env prefix ``GATEWAY_``), printed on start.

The replicas, routing policy, retries, timeouts and health checks are the LLM client's own settings
(``llm_client.config.ClientConfig``, env prefix ``LLM_``): the gateway adds only what belongs to the
HTTP face in front of them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.overload import DEFAULT_PER_REPLICA_IN_FLIGHT
from prompt_assembly.errors import ConfigurationError

Priority = Literal["high", "normal", "low"]
"""A request's priority class (``x-priority``): under overload ``low`` is refused first, ``high`` last."""

DEFAULT_MAX_WAIT_S: dict[Priority, float] = {"high": 10.0, "normal": 5.0, "low": 2.0}
"""The longest each class waits for a slot by default: ``low`` gives up first."""


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
        None,
        gt=0,
        description="whole request from its arrival: the wait for an admission slot, retries and "
        "streaming included; default: LLM timeouts",
    )

    # ---- overload (docs/gateway.md, "Overload, supersede, never pay twice") ------------------------
    per_replica_in_flight: int = Field(
        DEFAULT_PER_REPLICA_IN_FLIGHT,
        ge=1,
        description="requests sent to each routable replica at once (its running batch, max_batch_size); "
        "more wait in the gateway's queue, in priority order, where they can still be superseded",
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="requests sent to the replicas at once; None = routable replicas x "
        "per_replica_in_flight"
    )  # fmt: skip
    max_waiting: int | None = Field(
        None, ge=0, description="requests waiting for a slot at most; None = the in-flight limit. A "
        "request arriving to a full queue pushes out the newest waiter of a lower priority, else is refused"
    )  # fmt: skip
    max_wait_s: dict[Priority, float] = Field(
        default_factory=lambda: dict(DEFAULT_MAX_WAIT_S),
        description="the longest a request of each priority waits for a slot: refused with 429 at once "
        "when its predicted wait is longer, and when it has waited this long",
    )
    priority_header: str = Field("x-priority", description="high, normal (the default) or low")
    default_priority: Priority = "normal"
    session_version_header: str = Field(
        "x-session-version",
        description="with the routing-key header: this request supersedes the session's older versions",
    )
    cancel_superseded_in_flight: bool = Field(
        True, description="close the upstream request of a superseded request already sent (else it "
        "finishes and its caller gets its answer); one still waiting is always dropped"
    )  # fmt: skip
    session_versions_kept: int = Field(
        100_000, ge=1, description="sessions whose newest version is remembered (LRU), so an older "
        "version arriving late is refused"
    )  # fmt: skip
    idempotency_ttl_s: float = Field(
        600.0, gt=0, description="how long a finished answer is kept for a repeat of its Idempotency-Key"
    )
    idempotency_max_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="answers kept for repeats, in bytes at most (the oldest "
        "go first); 0 = keep none (calls in flight are still joined)"
    )  # fmt: skip

    @field_validator("max_wait_s", mode="after")
    @classmethod
    def _every_priority_bounded(cls, value: dict[Priority, float]) -> dict[Priority, float]:
        """A setting that names some classes keeps the defaults of the others."""
        if any(bound <= 0 for bound in value.values()):
            raise ConfigurationError(f"GATEWAY_MAX_WAIT_S: every bound must be above 0, not {value}")
        return {**DEFAULT_MAX_WAIT_S, **value}

    def wait_bound_s(self, priority: Priority) -> float:
        return self.max_wait_s[priority]

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
