"""Real-time service settings: one pydantic-settings model (env prefix ``REALTIME_``), printed on start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
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
    llm_top_k: int = Field(3, ge=1, le=50, description="candidates the model ranks and explains (the head)")
    llm_max_tokens: int = Field(64, ge=16, description="answer budget of a ranking call (~20 a candidate)")
    llm_concurrency_per_replica: int = Field(
        24, ge=1, description="calls in flight per routable replica; beyond it requests are answered degraded"
    )
    reason_max_chars: int = Field(80, ge=10)
