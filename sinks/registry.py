"""Sinks by name: the one place an engine's list of sinks is built from settings.

Engines call ``build_sinks`` and hold what it returns as ``ResultSink``s; none names a sink class. A new
sink is one module implementing ``sinks.base.ResultSink`` plus one entry in ``SINKS`` (and its name in
``sinks.config.SinkName``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import redis.asyncio as aioredis

from prompt_assembly.errors import ConfigurationError
from sinks.base import ResultSink
from sinks.config import SinkName, SinkSettings
from sinks.kafka import KafkaResultSink
from sinks.redis import RedisSignalSink
from sinks.s3 import S3InsightSink


@dataclass(frozen=True, slots=True)
class SinkResources:
    """What a sink shares with its engine instead of opening its own."""

    redis: aioredis.Redis | None = None
    """The engine's Redis client (the runner's session store uses it too); None = the sink opens one."""
    kafka: Mapping[str, object] = field(default_factory=dict)
    """librdkafka properties of the engine's Kafka cluster: bootstrap servers and TLS/SASL."""


SinkFactory = Callable[[SinkSettings, SinkResources], ResultSink]


def _redis(settings: SinkSettings, resources: SinkResources) -> ResultSink:
    return RedisSignalSink(settings, resources.redis)


def _s3(settings: SinkSettings, resources: SinkResources) -> ResultSink:
    return S3InsightSink(settings)


def _kafka(settings: SinkSettings, resources: SinkResources) -> ResultSink:
    if "bootstrap.servers" not in resources.kafka:
        raise ConfigurationError("the kafka sink needs the engine's Kafka cluster (bootstrap.servers)")
    return KafkaResultSink(settings.insights_topic, resources.kafka)


SINKS: Mapping[SinkName, SinkFactory] = MappingProxyType({"redis": _redis, "s3": _s3, "kafka": _kafka})


def build_sinks(
    settings: SinkSettings, resources: SinkResources, *, names: Iterable[SinkName] | None = None
) -> list[ResultSink]:
    """The sinks ``settings.enabled`` names (or ``names``), in that order."""
    return [SINKS[name](settings, resources) for name in (settings.enabled if names is None else names)]
