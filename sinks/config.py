"""Sink settings (env prefix ``SINK_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class SinkSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SINK_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_key_prefix: str = Field("su:", description="namespace for every key this project writes")
    signal_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="signals expire if a shopper goes quiet")
    s3_endpoint_url: str | None = Field(None, description="None = AWS; set for MinIO or moto")
    s3_bucket: str = "shopper-understanding"
    s3_prefix: str = "insights"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = Field(None, description="None = the default AWS credential chain")
    s3_secret_access_key: SecretStr | None = None
    s3_max_records: int = Field(5000, ge=1, description="flush when this many records are buffered")
    s3_max_age_s: float = Field(5.0, gt=0, description="flush records older than this")

    def s3_client_kwargs(self) -> dict[str, str | None]:
        """Keyword arguments for a boto3/aiobotocore S3 client."""
        kwargs: dict[str, str | None] = {"endpoint_url": self.s3_endpoint_url, "region_name": self.s3_region}
        if self.s3_access_key_id is not None:
            kwargs["aws_access_key_id"] = self.s3_access_key_id
            secret = self.s3_secret_access_key
            kwargs["aws_secret_access_key"] = None if secret is None else secret.get_secret_value()
        return kwargs
