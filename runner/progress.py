"""What the embedded runner counts, and the progress line it prints.

Everything that grows with a long run is bounded: freshness keeps the most recent samples only.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition

from pipeline.accounting import Accounting
from pipeline.overload import OverloadCounts, TokenCounts
from runner.dead_letters import DeadLetterCounts

FRESHNESS_SAMPLES_KEPT = 100_000


@dataclass(slots=True)
class RunnerStats:
    accounting: Accounting = field(default_factory=Accounting)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    estimated_shared_tokens: int = 0
    estimated_prompt_tokens: int = 0
    freshness_ms: deque[float] = field(default_factory=lambda: deque(maxlen=FRESHNESS_SAMPLES_KEPT))
    """Kafka timestamp of the triggering event -> result stored, most recent samples."""
    commits: int = 0
    last_commit_at: float | None = None
    """``time.monotonic()`` of the last offset commit, or of the last durable point that found nothing
    left to commit (up to date); None before either."""
    paused_times: int = 0
    long_wait_pauses: int = 0
    """Waits that outlasted ``runner.ingest.STORE_WAIT_BEFORE_PAUSE_S`` (for the session store: a load,
    an ownership check; or a shutdown's drain), so the partitions were paused to poll on."""
    fenced_saves: int = 0
    """Session saves the store refused because a newer owner had taken their partitions."""
    sink_retries: int = 0
    """Sink writes (Redis, S3, session store) retried after a failure (an outage, a restart)."""
    sessions_salvaged: int = 0
    """Stored sessions loaded with something this code could not read (``ShopperSession.salvage``)."""
    session_entries_unreadable: int = 0
    """Stored log entries those loads left out (every entry of a session that started over)."""
    dead_letters: DeadLetterCounts = field(default_factory=DeadLetterCounts)
    """Queued, delivered, shrunk and undelivered dead letters, and dead letters by reason category."""
    first_event_at: float | None = None
    last_event_at: float | None = None
    """Monotonic times of the first and last event processed: the ingest window."""

    @property
    def ingest_rate(self) -> float:
        """Events per second between the first and the last event processed."""
        if self.first_event_at is None or self.last_event_at is None:
            return 0.0
        return self.accounting.consumed / max(1e-9, self.last_event_at - self.first_event_at)

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ProgressLine:
    """Formats the periodic progress line (events/s since the previous line, lag, DLQ, prompts...)."""

    def __init__(self, stats: RunnerStats, *, consumed: str = "events") -> None:
        """``consumed``: what a consumed record is called (a prompts runner reads records of prompts)."""
        self.stats = stats
        self.consumed = consumed
        self._last_consumed = 0
        self._last_at = time.monotonic()

    def render(
        self,
        *,
        in_flight: int,
        lag: int | None,
        undelivered_dead_letters: int,
        final: bool,
        overload: OverloadCounts | None = None,
        waiting: int = 0,
        tokens: TokenCounts | None = None,
        not_drained_because: str | None = None,
    ) -> str:
        """``overload``: the enricher's counts of prompts not sent on their own (``docs/overload.md``);
        ``waiting``: prompts waiting at its admission gate now (part of ``in_flight``); ``tokens``: its
        tokens by whether their answer landed (``tokens-not-landed``: the share spent for nothing);
        ``not_drained_because``: with ``until_drained``, what the last drain check waited for."""
        now = time.monotonic()
        stats, acct = self.stats, self.stats.accounting
        rate = (acct.consumed - self._last_consumed) / max(1e-9, now - self._last_at)
        self._last_consumed, self._last_at = acct.consumed, now
        line = (
            f"[{'done' if final else 'progress'}] {self.consumed} {acct.consumed} ({rate:,.0f}/s) "
            f"lag {'-' if lag is None else lag} dlq {acct.dead_lettered} dup {acct.duplicates} "
            f"prompts {acct.prompts} in-flight {in_flight} insights {acct.insights} "
            f"errors {acct.errors} superseded {acct.superseded} cache-hit {stats.cache_hit_ratio:.0%} "
            f"commits {stats.commits}"
        )
        if waiting:
            line += f" waiting {waiting}"
        if overload is not None:
            not_sent = {
                "cancelled": overload.cancelled_in_flight,
                "stale": overload.dropped_stale,
                "replayed": overload.skipped_answered,
            }
            line += "".join(f" {name} {count}" for name, count in not_sent.items() if count)
        if tokens is not None and tokens.not_landed_prefill:
            line += f" tokens-not-landed {tokens.not_landed_share:.1%}"
        if stats.sink_retries:
            line += f" sink-retries {stats.sink_retries}"
        if stats.fenced_saves:
            line += f" fenced-saves {stats.fenced_saves}"
        if stats.sessions_salvaged:
            line += f" sessions-salvaged {stats.sessions_salvaged}"
        if undelivered_dead_letters:
            line += f" dead-letters-undelivered {undelivered_dead_letters}"
        if not_drained_because is not None and not final:
            line += f" (not drained: {not_drained_because})"
        return line


def cached_lag_by_partition(
    consumer: Consumer, assignment: list[TopicPartition], committed: dict[int, int] | None = None
) -> dict[int, int]:
    """Records behind the high watermark per assigned partition, from the watermarks the consumer
    last saw; a broker round trip only for partitions without a position (their committed offsets),
    and only once per assignment where the caller keeps ``committed`` for it (partition -> offset):
    this member does not move an unread partition's committed offset, so it stays what was read.
    Calls on the consumer wait behind a synchronous commit to an unreachable coordinator: call it on
    a thread (``EmbeddedRunner._measure_lag``)."""
    if not assignment:
        return {}
    committed = {} if committed is None else committed
    positions = consumer.position(assignment)
    # A partition nothing was consumed from since it was assigned has no position yet: its lag runs
    # from the group's committed offset (one round trip, for those only), not from 0. Measured from
    # 0, an idle partition another member had finished read as wholly behind, and kept the
    # "falling behind" alert on, until its next record came.
    unread = [tp for tp in positions if tp.offset < 0 and tp.partition not in committed]
    if unread:
        with contextlib.suppress(KafkaException):
            answered = consumer.committed(unread, timeout=5)
            committed.update({tp.partition: tp.offset for tp in answered if tp.error is None})
    lag = {}
    for tp in positions:
        low, high = consumer.get_watermark_offsets(tp, cached=True)
        if high >= 0:
            at = tp.offset if tp.offset >= 0 else committed.get(tp.partition, -1)
            lag[tp.partition] = max(0, high - max(at, low, 0))
    return lag
