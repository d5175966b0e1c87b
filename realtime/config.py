"""Real-time service settings: one pydantic-settings model (env prefix ``REALTIME_``), printed on start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class RealtimeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REALTIME_")

    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535, description="0 picks a free port (printed in the READY line)")
    default_deadline_ms: int = Field(300, ge=20, le=5000, description="when a request sets none")
    answer_reserve_ms: float = Field(
        15.0, ge=0, description="kept back from the deadline to build the fallback and write the answer"
    )
    max_lag_reserve_ms: float = Field(
        100.0, ge=0, description="also kept back: the event loop's recent lag, up to this (busy hosts)"
    )
    signal_reads: Literal["script", "pipeline"] = Field(
        "script", description="one Lua call (single Redis node) or a pipeline of HMGETs (Redis Cluster)"
    )
    redis_timeout_ms: float = Field(40.0, gt=0, description="signal reads give up after this (fallback data)")
    max_late_reads: int = Field(
        256,
        ge=0,
        description="signal reads given up on but left to finish, keeping their connections; past this "
        "they are cancelled (their connections closed), so a stalled Redis cannot pile up connections. "
        "Room for a busy Redis: at 400 requests/s every read may finish 0.6 s late before it bites",
    )
    llm_top_k: int = Field(3, ge=1, le=50, description="candidates the model ranks and explains (the head)")
    llm_max_tokens: int = Field(64, ge=16, description="answer budget of a ranking call (~20 a candidate)")
    llm_concurrency_per_replica: int = Field(
        24,
        ge=1,
        description="calls in flight per servable replica (routable, else drained but healthy); beyond it "
        "requests are answered degraded",
    )
    reason_max_chars: int = Field(80, ge=10)
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop",
        description="uvloop (libuv, in C) or the standard library's loop: same behaviour, and uvloop cut "
        "the service's CPU per request (docs/realtime.md)",
    )

    # Security (docs/security.md). Every guard is off or generous by default so a local stack just works.
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="accepted API keys (X-API-Key or Authorization: Bearer); empty = no authentication. "
        'Env: REALTIME_API_KEYS=\'["key-1","key-2"]\'',
    )
    public_paths: tuple[str, ...] = Field(
        ("/health", "/metrics", "/openapi.json"),
        description="paths served without a key (probes, scrapes, the spec)",
    )
    max_body_bytes: int = Field(256 * 1024, ge=1024, description="larger request bodies get 413")
    rate_limit_per_s: float = Field(
        0.0, ge=0, description="requests a second per client (API key, else remote address); 0 = off"
    )
    rate_limit_burst: int = Field(50, ge=1, description="requests a client may send at once")
    rate_limit_max_clients: int = Field(
        10_000, ge=1, description="clients tracked at once (least recently seen forgotten first)"
    )
