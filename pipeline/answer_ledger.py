"""Never pay twice for one prompt: each answer is recorded in Redis the moment it arrives, by the
prompt's ``request_id`` (``shopper:session_epoch:seq``, the same on every replay of the same events).

An engine replays prompts after a crash, a restart or a rebalance: everything after its last durable
point. Without a record, every prompt whose answer came back after that point is sent to the model
again. With it, ``pipeline.enrichment.Enricher`` reads the record first and returns the recorded answer
(``ShopperInsight.replayed``) without a call. The record is written before the engine's sinks see the
answer, so it never trails the engine's checkpoint.

Reads are batched: every ``recorded`` asked for in one turn of the event loop goes to Redis as one
``MGET``, and every caller resumes in the same later turn, in the order it asked. An engine hands a
whole poll's (or bundle's) prompts to the enrichment step at once, several of them one shopper's;
with a read each, the replies came back in any order, so an older prompt could pass latest wins and be
sent before its newer sibling's read returned, only to be cancelled in flight a moment later (on a
backlog more than a third of the calls, and each a call a replay after a kill makes again). Read
together, the older prompt meets the newer one while it is still waiting, and is superseded unsent.
Writes are batched the same way (one pipeline per loop turn), so a burst of answers reaches Redis in one
round trip rather than one connection each.

Only insights are recorded: an error or a superseded prompt cost little or nothing, and asking again
on replay is what a person would want, unless the shopper has a newer answer by now. So the same read
also takes the version of the shopper's signal (``lookup``: the newest answer any process stored, the
Redis sink keeps it newer-wins): a replayed prompt older than that in its own session is superseded
without a call, where before it was sent once more (its shopper's newer prompt had superseded it before
the crash, and after the replay nothing newer was waiting to do it again).

The answers a process recorded last are also kept in its memory (``RECENT_ANSWERS_KEPT``) and answer a
lookup that Redis could not: a read Redis answered before an answer's write, but that reached its
caller only after the answer's call had ended (a large ``MGET`` reply parsed after a small ``SET``'s),
found neither a record nor a call to join, and a replayed copy paid again.

Each key expires after ``SinkSettings.answer_ttl_s``, so the ledger is bounded by the prompt rate
times that TTL. Redis being away never stops the stream: a failed read asks the model (the pre-ledger
behaviour), a failed write loses only the saving; both are counted. Any other error its client raises
is met the same way, and logged with its traceback: only the loop closing cancels a waiting read.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from prompt_assembly.records import PromptRequest, ShopperInsight
from sinks.config import SinkSettings
from sinks.keys import RedisKeys

log = logging.getLogger(__name__)

RECENT_ANSWERS_KEPT = 4096
"""Answers a process recorded last, kept in memory as well, as their JSON (about 5 MB with ~1 KB
answers; parsed they took 22 MB): many times what a read's round trip overlaps with at any rate a
process answers."""

MAX_KEYS_PER_MGET = 512
"""One batch's keys go to Redis as ``MGET`` commands of at most this many keys, in one pipeline (one
round trip), so a large poll never makes one huge command."""


@dataclass(slots=True)
class LedgerCounts:
    recorded: int = 0
    found: int = 0
    """Recorded answers a lookup returned (an answer for other events is ``other_events`` instead)."""
    read_failures: int = 0
    write_failures: int = 0
    other_events: int = 0
    """Answers found under a prompt's ``request_id`` that were for other events (``lookup``): the prompt
    is answered on its own, and its answer replaces the record."""
    read_batches: int = 0
    """Round trips that read the ledger (each for every ``recorded`` asked in one loop turn)."""
    write_batches: int = 0
    """Round trips that wrote it (each for every ``record`` asked in one loop turn)."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the ledger knows of a prompt: its recorded answer, and its shopper's newest stored one."""

    answer: ShopperInsight | None
    newest_answered: tuple[int, int] | None
    """``(session_epoch, seq)`` of the shopper's signal in Redis; None when there is none (or it was
    not asked: ``recorded``)."""


_Read = tuple[bytes | None, tuple[int, int] | None]
_Waiting = list[tuple[str, str | None, "asyncio.Future[_Read]"]]
_Writing = list[tuple[str, bytes, "asyncio.Future[None]"]]


class AnswerLedger:
    """The answers already paid for, by ``request_id``; shared by every process of a deployment."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.counts = LedgerCounts()
        self._waiting: _Waiting = []
        self._writing: _Writing = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: OrderedDict[str, bytes] = OrderedDict()
        """The answers this process recorded last, as written (JSON: ~1 KB each; parsed, ~5 KB)."""

    @classmethod
    def from_settings(cls, settings: SinkSettings, redis: aioredis.Redis | None = None) -> AnswerLedger:
        """The ledger at the sinks' Redis and key prefix (``redis``: an engine's shared client)."""
        client = redis if redis is not None else settings.redis_client()
        return cls(client, RedisKeys(settings.redis_key_prefix), settings.answer_ttl_s)

    async def recorded(self, request_id: str) -> ShopperInsight | None:
        """The answer recorded for ``request_id``, or None (also when Redis cannot be read)."""
        answer = (await self._lookup(request_id, None)).answer
        if answer is not None:
            self.counts.found += 1
        return answer

    async def lookup(self, prompt: PromptRequest) -> Recorded:
        """The answer recorded for ``prompt`` and the version of its shopper's signal (neither, when
        Redis cannot be read). Read in one batch with every other read of this loop turn (see the
        module's docstring). An answer recorded under its ``request_id`` for other events is not its
        answer (``other_events``): a restored Flink job can make the same session version with an event
        more, since its restored timer waits for the replay (``flink_jobs.pause_timers``), and reused,
        that answer would leave the event named by no result. The prompt's own answer replaces it."""
        known = await self._lookup(prompt.request_id, prompt.shopper_id)
        answer = known.answer
        if answer is None:
            return known
        if (
            answer.new_event_ids == prompt.new_event_ids
            and answer.trimmed_event_ids == prompt.trimmed_event_ids
        ):
            self.counts.found += 1
            return known
        self.counts.other_events += 1
        return Recorded(None, known.newest_answered)

    async def _lookup(self, request_id: str, shopper_id: str | None) -> Recorded:
        future: asyncio.Future[_Read] = asyncio.get_running_loop().create_future()
        if not self._waiting:  # its first step, a loop turn from now, takes every read asked by then
            self._hold(asyncio.get_running_loop().create_task(self._read_waiting()))
        self._waiting.append((request_id, shopper_id, future))
        try:
            raw, newest = await future
        except Exception:  # Redis away, or its client failed: ask the model (``_read`` logged it)
            self.counts.read_failures += 1
            raw, newest = None, None
        if raw is None:  # or not yet: an answer this process recorded meanwhile
            raw = self._recent.get(request_id)
        if raw is None:
            return Recorded(None, newest)
        try:
            insight = ShopperInsight.model_validate_json(raw)
        except ValidationError:  # written by another version of the record: ask the model again
            self.counts.read_failures += 1
            return Recorded(None, newest)
        return Recorded(insight, newest)

    async def _read_waiting(self) -> None:
        batch, self._waiting = self._waiting, []
        await self._read(batch)

    def _hold(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    async def _read(self, batch: _Waiting) -> None:
        """One round trip for ``batch``: the answers by ``MGET``, each asked shopper's signal version by
        ``HMGET``; each waiter gets its values, or the error, in the order asked (a waiter cancelled
        meanwhile is skipped)."""
        outcome: list[_Read] | BaseException
        try:
            pipe = self.redis.pipeline(transaction=False)
            for start in range(0, len(batch), MAX_KEYS_PER_MGET):
                pipe.mget([self.keys.answer(rid) for rid, _, _ in batch[start : start + MAX_KEYS_PER_MGET]])
            shoppers = list(dict.fromkeys(sid for _, sid, _ in batch if sid is not None))
            for sid in shoppers:
                pipe.hmget(self.keys.signals(sid), ["session_epoch", "seq"])
            replies = await pipe.execute()
            chunks = -(-len(batch) // MAX_KEYS_PER_MGET)
            answers = [value for values in replies[:chunks] for value in values]
            versions = dict(zip(shoppers, map(_version, replies[chunks:]), strict=True))
            outcome = [
                (answers[i], None if sid is None else versions[sid]) for i, (_, sid, _) in enumerate(batch)
            ]
            self.counts.read_batches += 1
        except Exception as exc:  # each waiter asks the model; only the loop closing cancels them
            _log_failure("read", exc)
            outcome = exc
        except BaseException as exc:  # cancelled (the loop is closing): no waiter is left hanging
            for _, _, future in batch:
                if not future.done():
                    future.cancel()
            raise exc
        for i, (_, _, future) in enumerate(batch):
            if future.done():
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome[i])

    async def record(self, insight: ShopperInsight) -> None:
        """Record ``insight`` under its ``request_id`` with the ledger's TTL (a replayed write of the
        same answer only renews it). Written in one pipeline with every other ``record`` of this loop
        turn: answers arrive in bursts (a batch of replicas' replies), and a command each took a
        connection each from the pool, opening new ones under a burst, so the last answer of a burst
        reached Redis long after it arrived (and a kill in between pays for it again)."""
        answer = insight.model_dump_json().encode()
        self._recent[insight.request_id] = answer
        self._recent.move_to_end(insight.request_id)
        if len(self._recent) > RECENT_ANSWERS_KEPT:
            self._recent.popitem(last=False)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._writing:
            self._hold(asyncio.get_running_loop().create_task(self._write_waiting()))
        self._writing.append((self.keys.answer(insight.request_id), answer, future))
        await future

    async def _write_waiting(self) -> None:
        """One round trip for every ``record`` asked by now; each writer is released when it is done,
        counted as recorded or as a failure (never raised: a lost write loses only the saving)."""
        batch, self._writing = self._writing, []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key, value, _ in batch:
                pipe.set(key, value, ex=self.ttl_s)
            await pipe.execute()
            self.counts.recorded += len(batch)
            self.counts.write_batches += 1
        except Exception as exc:
            _log_failure("write", exc)
            self.counts.write_failures += len(batch)
        finally:
            for _, _, future in batch:
                if not future.done():
                    future.set_result(None)


def _log_failure(what: str, exc: Exception) -> None:
    """Redis away is expected (counted, and the stream goes on; a batch forms every loop turn, so a
    line each would flood the log); anything else its client raised is a fault to find, so it is
    logged with its traceback, though the stream goes on the same way."""
    if isinstance(exc, RedisError):
        log.debug("answer ledger %s failed: %s", what, exc)
    else:
        log.error("answer ledger %s failed", what, exc_info=exc)


def _version(fields: list[bytes | None]) -> tuple[int, int] | None:
    """``(session_epoch, seq)`` from a signal's ``HMGET``; None when there is no signal (or it does not
    read as a version: then nothing is superseded on its word)."""
    epoch, seq = fields
    if seq is None:
        return None
    try:
        return int(epoch or 0), int(seq)
    except ValueError:
        return None
