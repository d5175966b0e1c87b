"""Job bookkeeping (pure): the manifest checkpointed to S3, and which shards are complete.

The input is cut into shards of ``shard_records`` consecutive lines; shard ``k`` always covers lines
``[k * shard_records, (k + 1) * shard_records)`` and its rows always go to the same object
(``part-{k:05d}.jsonl``), so a redone shard overwrites its part instead of adding a second copy: every
record lands in exactly one output object, however often the job is killed and resumed.

A shard is *committed* once its part is written; the manifest lists committed shards with their
counts. A resumed job skips committed shards and redoes only shards that were in progress, so the
work redone after a kill is bounded by the records in flight plus one shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class JobSpec(BaseModel):
    """What was asked for; never changes after submission."""

    job_id: str
    input_uri: str
    output_uri: str
    priority: int = 0
    shard_records: int = Field(100, ge=1)
    pool: str = "batch"
    submitted_at: float = Field(default_factory=time.time)


class ShardCounts(BaseModel):
    ok: int = 0
    errors: int = 0
    requests: int = 0
    """LLM calls the shard's records took (map parts, reduces, retries)."""


class JobManifest(BaseModel):
    """The checkpoint: enough to resume without redoing a committed shard."""

    spec: JobSpec
    state: JobState = "queued"
    input_etag: str | None = None
    """The input object's ETag when the job first ran: a resume refuses a changed input."""
    input_bytes: int | None = None
    total_records: int | None = None
    """Input lines, known once the input has been read to its end."""
    shards: dict[int, ShardCounts] = Field(default_factory=dict)
    runs: int = 0
    message: str | None = None
    errors_uri: str | None = None
    updated_at: float = Field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def total_shards(self) -> int | None:
        if self.total_records is None:
            return None
        return -(-self.total_records // self.spec.shard_records)

    @property
    def records_done(self) -> int:
        return sum(c.ok + c.errors for c in self.shards.values())

    @property
    def records_ok(self) -> int:
        return sum(c.ok for c in self.shards.values())

    @property
    def records_failed(self) -> int:
        return sum(c.errors for c in self.shards.values())

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.shards.values())

    @property
    def complete(self) -> bool:
        total = self.total_shards
        return total is not None and all(k in self.shards for k in range(total))

    def summary(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "priority": self.spec.priority,
            "input": self.spec.input_uri,
            "output": self.spec.output_uri,
            "records_total": self.total_records,
            "records_done": self.records_done,
            "records_ok": self.records_ok,
            "records_failed": self.records_failed,
            "llm_requests": self.requests,
            "shards_committed": len(self.shards),
            "shards_total": self.total_shards,
            "runs": self.runs,
            "errors_file": self.errors_uri,
            "message": self.message,
        }


@dataclass(slots=True)
class ShardCommit:
    """A complete shard, ready to be written: rows and error rows sorted by input line."""

    shard: int
    rows: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    counts: ShardCounts


@dataclass(slots=True)
class _OpenShard:
    expected: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0

    @property
    def received(self) -> int:
        return len(self.rows) + len(self.errors)


class ShardBook:
    """Collects finished rows per shard and says when a shard is complete.

    ``seal_through(n)`` says the reader has seen ``n`` lines, which fixes how many rows every shard
    ending at or before line ``n`` must hold; ``finish(n)`` says the input has exactly ``n`` lines.
    A shard is complete when sealed and all its rows are in. Committed shards are never reopened:
    rows for them (which the job never dispatches) are ignored.
    """

    def __init__(self, shard_records: int, committed: set[int] | None = None) -> None:
        self.shard_records = shard_records
        self.committed: set[int] = set(committed or ())
        self._open: dict[int, _OpenShard] = {}
        self._sealed_lines = 0

    def shard_of(self, line: int) -> int:
        return line // self.shard_records

    @property
    def open_records(self) -> int:
        """Rows held in memory, waiting for their shard to complete."""
        return sum(s.received for s in self._open.values())

    def add(self, line: int, row: dict[str, Any], *, error: bool, requests: int) -> list[ShardCommit]:
        shard = self.shard_of(line)
        if shard in self.committed:
            return []
        book = self._open.setdefault(shard, _OpenShard())
        (book.errors if error else book.rows).append(row)
        book.requests += requests
        return self._ready([shard])

    def seal_through(self, lines: int) -> list[ShardCommit]:
        """The reader has read ``lines`` lines; every shard that ends by then is full size."""
        first = self._sealed_lines // self.shard_records
        self._sealed_lines = max(self._sealed_lines, lines)
        last = self._sealed_lines // self.shard_records
        touched = []
        for shard in range(first, last):
            if shard not in self.committed:
                self._open.setdefault(shard, _OpenShard()).expected = self.shard_records
                touched.append(shard)
        return self._ready(touched)

    def finish(self, lines: int) -> list[ShardCommit]:
        """The input has exactly ``lines`` lines: the last shard may be short."""
        commits = self.seal_through(lines)
        shard, rest = divmod(lines, self.shard_records)
        if rest and shard not in self.committed:
            self._open.setdefault(shard, _OpenShard()).expected = rest
            commits += self._ready([shard])
        return commits

    def _ready(self, shards: list[int]) -> list[ShardCommit]:
        commits = []
        for shard in shards:
            book = self._open.get(shard)
            if book is None or book.expected is None or book.received < book.expected:
                continue
            del self._open[shard]
            self.committed.add(shard)
            book.rows.sort(key=lambda r: r["line"])
            book.errors.sort(key=lambda r: r["line"])
            counts = ShardCounts(ok=len(book.rows), errors=len(book.errors), requests=book.requests)
            commits.append(ShardCommit(shard, book.rows, book.errors, counts))
        return commits
