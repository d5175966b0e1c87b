"""Client configuration: one pydantic-settings model, read from the environment (prefix ``LLM_``),
with every timeout and limit an explicit, documented field rather than a bare float in a call.

The routing policy is chosen by name (``policy``, e.g. ``LLM_POLICY=prefix_aware`` or, nested in the
runner's settings, ``RUNNER_LLM__POLICY=prefix_aware``) and configured with that policy's own typed
settings (``policy_settings``, a union tagged by ``policy``), e.g.
``LLM_POLICY_SETTINGS='{"policy": "prefix_aware", "load_factor": 1.25, "kv_events": "precise"}'``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llm_client.answer_health import AnswerHealthSettings
from llm_client.answers import AnswerLimits
from llm_client.routing import POLICIES, PolicyName, PolicySettings
from llm_client.transport import EndpointSecurity
from prompt_assembly.errors import ConfigurationError


class Timeouts(BaseModel):
    connect_s: float = Field(1.0, gt=0, description="TCP connect to a replica")
    attempt_s: float = Field(
        30.0,
        gt=0,
        description="one attempt, first byte to last; for a pass-through (the gateway's forward), the "
        "longest stall: no byte for this long (its answer is passed on as it arrives)",
    )
    deadline_s: float = Field(60.0, gt=0, description="whole request, retries included (default)")
    cut_grace_s: float = Field(
        0.0,
        ge=0,
        description="an attempt whose caller stopped waiting (its deadline) reads on in the background "
        "for up to this long, so that its connection is kept instead of closed (llm_client.cut_calls); "
        "0: closed at once, which tells the replica to stop (the stream engines' latest wins needs that)",
    )


class RetrySettings(BaseModel):
    max_attempts: int = Field(3, ge=1, description="attempts per request, across replicas")
    backoff_base_s: float = Field(0.05, ge=0, description="first backoff; doubles per attempt")
    backoff_max_s: float = Field(1.0, ge=0)
    budget_ratio: float = Field(
        0.2, ge=0, description="retries allowed per request made (token bucket), as in Finagle/gRPC"
    )
    budget_min_tokens: float = Field(10.0, ge=0, description="retries always allowed at low volume")


class HealthSettings(BaseModel):
    interval_s: float = Field(1.0, gt=0, description="probe of ejected replicas' /health")
    eject_after_failures: int = Field(2, ge=1, description="consecutive failures that eject a replica")


class ClientConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_", env_nested_delimiter="__", hide_input_in_errors=True)

    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    context_endpoints: list[str] = Field(
        default_factory=list,
        description="P/D disaggregation: the context (prefill) servers; endpoints are then the generation "
        "(decode) servers, and the policy must be pd_aware (llm_client.routing.pd_aware)",
    )
    model: str = "default"
    policy: PolicyName = Field(
        "prefix_aware",
        description="routing policy name, see llm_client.routing (docs/routing.md compares them)",
    )
    policy_settings: PolicySettings | None = Field(
        None, description="the policy's typed knobs, tagged with its name (None: its defaults)"
    )
    max_in_flight: int = Field(256, ge=1, description="concurrent requests; callers wait beyond it")
    stream: bool = Field(True, description="stream answers (measures time to first token)")
    timeouts: Timeouts = Field(default_factory=Timeouts)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    answer_limits: AnswerLimits = Field(
        default_factory=AnswerLimits, description="bytes one answer may make the client read"
    )
    answer_health: AnswerHealthSettings = Field(
        default_factory=AnswerHealthSettings, description="when invalid answers quarantine a replica"
    )
    cache_salt: str | None = Field(None, description="per-tenant KV-cache isolation (vLLM/TRT-LLM)")
    security: EndpointSecurity = Field(
        default_factory=EndpointSecurity, description="bearer API key and CA bundle (llm_client.transport)"
    )

    @field_validator("endpoints")
    @classmethod
    def _some_endpoints(cls, endpoints: list[str]) -> list[str]:
        if not endpoints:
            raise ConfigurationError("endpoints is empty: at least one replica URL is needed")
        bad = [url for url in endpoints if not url.startswith(("http://", "https://"))]
        if bad:
            raise ConfigurationError(f"endpoints must be http:// or https:// URLs ({len(bad)} are not)")
        return endpoints

    @model_validator(mode="after")
    def _context_servers_need_pd_routing(self) -> ClientConfig:
        if (
            self.context_endpoints
            and self.policy != "pd_aware"
            and (self.policy_settings is None or self.policy_settings.policy != "pd_aware")
        ):
            raise ConfigurationError(
                f"context_endpoints are set but the policy is {self.policy!r}: P/D needs policy pd_aware"
            )
        return self

    @model_validator(mode="after")
    def _settings_match_policy(self) -> ClientConfig:
        if self.policy_settings is not None and self.policy_settings.policy != self.policy:
            if "policy" in self.model_fields_set:
                raise ValueError(
                    f"policy_settings are for {self.policy_settings.policy!r} but policy is {self.policy!r}"
                )
            self.policy = self.policy_settings.policy  # settings alone select their policy
        return self

    def routing(self) -> PolicySettings:
        """The selected policy's settings (its defaults unless ``policy_settings`` are for it).

        Settings for another policy are an error: they may have been left over by an override of
        ``policy`` that skipped validation (``model_copy(update=...)``)."""
        if self.policy_settings is None:
            settings: PolicySettings = POLICIES[self.policy].settings_type.model_validate({})
            return settings
        if self.policy_settings.policy != self.policy:
            raise ValueError(
                f"policy_settings are for {self.policy_settings.policy!r} but policy is {self.policy!r}"
            )
        return self.policy_settings
