"""Kafka topic names of the near-real-time pipeline: the one place both engines and the stack take them."""

from __future__ import annotations

EVENTS_TOPIC = "shopper-events"
"""Shopper activity, keyed by ``shopper_id`` (so a shopper's events share a partition)."""

DLQ_TOPIC = "shopper-events-dlq"
"""Dead letters: every record the gate rejected, with its reason and where it came from."""

INSIGHTS_TOPIC = "shopper-insights"
"""Results (insights and error records) as JSON, for consumers other than Redis and S3 (Flink only)."""

PROMPTS_TOPIC = "shopper-prompts"
"""The Flink job's prompts (``PromptRequest`` JSON, keyed by ``shopper_id``), for the runner with input
'prompts' that enriches them: the job's default hand-over (``NearRealtimeSettings.prompts_topic``)."""
