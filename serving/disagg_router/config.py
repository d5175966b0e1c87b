"""The ``trtllm-serve disaggregated`` YAML, read as ``tensorrt_llm/llmapi/disagg_utils.py`` reads it.

What the front end uses: each pool's ``urls`` (``num_instances`` of them, ``host:port`` or a full URL)
and ``router``, ``conditional_disagg_config``, ``max_retries`` and ``perf_metrics_max_requests``. The
router's settings are built as ``extract_router_config`` builds them: ``type`` (default ``round_robin``),
every other key of ``router:`` as the router's arguments, the pool's own ``max_batch_size`` /
``max_num_tokens`` copied over them, and ``kv_cache_config.tokens_per_block`` used when the router sets
none. Other keys (``backend``, engine options) configure the servers, not the front end: accepted and
ignored. As in TensorRT-LLM, conditional disaggregation needs a ``kv_cache_aware`` generation router.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prompt_assembly.errors import ConfigurationError

RouterType = Literal["round_robin", "load_balancing", "kv_cache_aware"]


class RouterSettings(BaseModel):
    """A pool's router and the constructor arguments TensorRT-LLM passes it (unknown ones are
    swallowed by the constructor's ``**kwargs`` there, and ignored here)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    type: RouterType = "round_robin"
    use_tokens: bool = Field(
        False, description="load_balancing: load is active prompt tokens, not active requests"
    )
    max_batch_size: int = Field(64, ge=1, description="kv_cache_aware: load = active requests / this")
    tokens_per_block: int = Field(32, ge=1, description="kv_cache_aware: must equal the servers' block size")
    backfill_block_hashes_on_finish: bool = Field(
        False,
        description="kv_cache_aware: add a finished request's blocks to its server's table without "
        "waiting for events (TensorRT-LLM's workaround for servers that publish none)",
    )


class PoolSettings(BaseModel):
    """``context_servers`` or ``generation_servers``."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    num_instances: int = Field(1, ge=1)
    urls: list[str] = Field(min_length=1)
    router: dict[str, Any] = Field(default_factory=dict)
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    kv_cache_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_url_per_instance(self) -> PoolSettings:
        if len(self.urls) != self.num_instances:
            raise ValueError(
                f"Number of hostnames ({len(self.urls)}) should be equal to the number of instances "
                f"({self.num_instances})"
            )
        return self

    def router_settings(self) -> RouterSettings:
        """``extract_router_config``: the router block, the pool's batch limits over it, and the
        servers' ``tokens_per_block`` unless the router names its own."""
        args = dict(self.router)
        for key in ("max_batch_size", "max_num_tokens"):
            if getattr(self, key) is not None:
                args[key] = getattr(self, key)
        if "tokens_per_block" not in args and "tokens_per_block" in self.kv_cache_config:
            args["tokens_per_block"] = self.kv_cache_config["tokens_per_block"]
        return RouterSettings.model_validate(args)

    def base_urls(self) -> list[str]:
        """The servers as URLs (TensorRT-LLM's ``http://`` + ``host:port``)."""
        return [u if u.startswith(("http://", "https://")) else f"http://{u}" for u in self.urls]


class ConditionalDisagg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_local_prefill_length: int = Field(0, ge=0)


class DisaggConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    hostname: str = "localhost"
    port: int = Field(8000, ge=0, le=65535)
    max_retries: int = Field(1, ge=0, description="retries of a worker request that failed in transport")
    perf_metrics_max_requests: int = Field(
        0, ge=0, description="requests kept for GET /perf_metrics; 0 (the default) keeps none"
    )
    context_servers: PoolSettings
    generation_servers: PoolSettings
    conditional_disagg_config: ConditionalDisagg | None = None

    @model_validator(mode="after")
    def _conditional_needs_kv_cache_aware(self) -> DisaggConfig:
        gen = self.generation_servers.router_settings().type
        if self.conditional_disagg_config is not None and gen != "kv_cache_aware":
            raise ValueError(
                "Generation router must be a KvCacheAwareRouter to enable conditional disaggregation"
            )
        return self

    @classmethod
    def load(cls, path: str | Path) -> DisaggConfig:
        """Read and validate the YAML; ``ConfigurationError`` names the file and what is wrong."""
        try:
            document = yaml.safe_load(Path(path).read_text())
            return cls.model_validate(document)
        except (OSError, yaml.YAMLError, ValueError) as exc:
            reason = f"{path}: not a usable trtllm-serve disaggregated config: {exc}"
            raise ConfigurationError(reason) from exc

    def with_overrides(
        self,
        *,
        context_urls: list[str] | None = None,
        generation_urls: list[str] | None = None,
        **fields: Any,
    ) -> DisaggConfig:
        """The same config with each pool's URLs replaced when given (tests and benchmarks point it at
        simulator processes on free ports) and top-level fields changed; validated again."""
        document = self.model_dump()
        for pool, urls in (("context_servers", context_urls), ("generation_servers", generation_urls)):
            if urls:
                document[pool].update(urls=list(urls), num_instances=len(urls))
        document.update(fields)
        return DisaggConfig.model_validate(document)
