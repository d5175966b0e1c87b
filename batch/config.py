"""Batch settings: one pydantic-settings model (env prefix ``BATCH_``), printed when a worker starts."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from batch.aimd import AimdSettings
from batch.documents import PromptBudget


class BatchSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCH_", env_nested_delimiter="__")

    jobs_prefix: str = Field("batch-jobs", description="S3 prefix (in the sink bucket) of job manifests")
    shard_records: int = Field(
        100, ge=1, description="input lines per output part: the unit of resume (a kill redoes about one)"
    )
    budget: PromptBudget = Field(default_factory=PromptBudget)
    max_line_bytes: int = Field(
        8 << 20,
        ge=1,
        description="an input line longer than this is an 'oversized' error row, never read whole; "
        "8 MiB is 8x what the default budget can use (32 parts of 8k tokens, about 1 MB of text)",
    )
    aimd: AimdSettings = Field(default_factory=AimdSettings)
    per_replica_budget: int = Field(
        128, ge=1, description="capacity budget: concurrent calls per replica of the pool (cap of AIMD)"
    )
    call_deadline_s: float = Field(120.0, gt=0, description="one LLM call, retries included")
    call_attempts: int = Field(2, ge=1, description="tries of a failed call (after the client's own retries)")
    guided_json: bool = Field(True, description="send the JSON schema as response_format")
    checkpoint_interval_s: float = Field(1.0, gt=0, description="manifest write / cancel check period")
    commit_concurrency: int = Field(4, ge=1, description="shard parts written to S3 at once")
    lease_ttl_s: float = Field(15.0, gt=0, description="a worker's claim on a job; refreshed each checkpoint")
    product_signal_ttl_s: int = Field(30 * 24 * 3600, gt=0, description="product signals in Redis expire")
    max_running_jobs: int = Field(4, ge=1, description="jobs one worker runs at once")
