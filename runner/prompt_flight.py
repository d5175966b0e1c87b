"""Prompts in flight: each launched prompt is enriched (the LLM call) and its result stored, in a task
of its own; its epoch counts it until the result is stored, so no offset is committed past it.

Owns the in-flight count that backpressure reads, and the Kafka time of each prompt's triggering
event, from which freshness (event produced -> result stored) is measured.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from prompt_assembly.records import EnrichmentError, EnrichmentResult, PromptRequest, ShopperInsight
from runner.epochs import Epoch

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner


class PromptFlight:
    def __init__(self, runner: EmbeddedRunner) -> None:
        self.runner = runner
        self.in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._kafka_ts: dict[str, float] = {}

    def launch(self, prompt: PromptRequest, epoch: Epoch, kafka_ts: float | None) -> None:
        stats = self.runner.stats
        epoch.pending += 1
        self.in_flight += 1
        stats.accounting.prompts += 1
        stats.accounting.trimmed_unprompted += prompt.trimmed_events
        stats.estimated_prompt_tokens += prompt.prompt_tokens
        stats.estimated_shared_tokens += prompt.shared_prefix_tokens
        if kafka_ts:
            self._kafka_ts[prompt.request_id] = kafka_ts
        task = asyncio.create_task(self._enrich(prompt, epoch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_all(self) -> None:
        """Until every launched prompt has finished (stored, or failed the runner)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _enrich(self, prompt: PromptRequest, epoch: Epoch) -> None:
        try:
            result = await self.runner.enricher.enrich(prompt)  # never raises: an error is a result too
            await self._store_result(result)
        except Exception as exc:  # a store stayed down past sink_retry: stop without committing
            self.runner.fail(exc)
            return
        finally:
            self.in_flight -= 1
        epoch.pending -= 1

    async def _store_result(self, result: EnrichmentResult) -> None:
        runner = self.runner
        await runner.checkpoint.write([result])  # buffering sinks are flushed at the durable point
        stats = runner.stats
        acct = stats.accounting
        if isinstance(result, ShopperInsight):
            acct.insights += 1
            if not result.replayed:  # a ledger's or a joined call's answer: its tokens are counted once
                stats.prompt_tokens += result.usage.prompt_tokens
                stats.cached_tokens += result.usage.cached_tokens
        elif isinstance(result, EnrichmentError):
            acct.errors += 1
            runner.log(f"error record {result.request_id}: {result.error_type}: {result.message[:160]}")
        else:  # not answered on purpose (pipeline.overload: a newer prompt won, or it went stale)
            acct.superseded += 1
        produced = self._kafka_ts.pop(result.request_id, None)
        freshness_ms = None if produced is None else (time.time() - produced) * 1000
        if freshness_ms is not None:
            stats.freshness_ms.append(freshness_ms)
        runner.metrics.observe_result(result, freshness_ms)
