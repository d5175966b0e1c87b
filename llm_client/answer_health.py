"""A replica's answer health: one that keeps sending invalid answers is quarantined until a probe passes.

A replica can be up, fast and answering ``/health`` while every answer it sends is unusable (a bad model
build, a broken template, a proxy's error page, megabytes of nonsense). Neither ejection (connection
failures) nor the degradation detector (drift from peers, which needs peers and samples) catches that
quickly, and affinity keeps sending a shopper back to the replica that failed it. So each replica's last
``window`` answers are judged on their own: when at least ``min_invalid`` of them, and at least
``invalid_share`` of them, were invalid (``InvalidAnswer``), the replica is *quarantined*: no new
requests, its reason (the most frequent kind of invalid answer) in the log and on ``/metrics``.

After ``cooldown_s`` the client probes it with a known-good request: the last one a replica of its pool
answered well (``llm_client.answer_probes``; a small completion with the configured model name when no
answer was good yet); a pass re-admits it on probation (an empty window), a failure keeps it out for
another cool-down. A replica quarantined again soon after is kept out twice as long, up to
``max_cooldown_s``. The last routable replica is never quarantined: if every replica answers badly the
fault is more likely the caller's schema than the fleet, and error records say so.

Pure and synchronous; time comes from an injectable clock. Like the degradation detector it never
writes an ``Endpoint``: it returns decisions, and the client applies them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from llm_client.endpoints import Endpoint
from llm_client.errors import InvalidAnswerKind

log = logging.getLogger(__name__)


class AnswerHealthSettings(BaseModel):
    """``LLM_ANSWER_HEALTH__*``: when invalid answers take a replica out of routing."""

    window: int = Field(10, ge=1, description="last answers judged per replica")
    min_invalid: int = Field(3, ge=1, description="invalid answers in the window that may quarantine")
    invalid_share: float = Field(0.5, gt=0, le=1, description="... when also this share of the window")
    cooldown_s: float = Field(10.0, gt=0, description="time out before the first probe")
    max_cooldown_s: float = Field(300.0, gt=0, description="cap of the doubling cool-down")


@dataclass(frozen=True, slots=True)
class Quarantine:
    """One decision, for logs, metrics and tests."""

    endpoint: str
    reason: InvalidAnswerKind
    detail: str


@dataclass(slots=True)
class _Record:
    answers: deque[InvalidAnswerKind | None]
    quarantined_at: float | None = None
    cooldown_s: float = 0.0
    last_detail: str = ""


@dataclass
class AnswerHealth:
    """Feeds on every answer the client reads, good ones included (the window is a share of answers);
    decides quarantines and when to probe."""

    settings: AnswerHealthSettings = field(default_factory=AnswerHealthSettings)
    clock: Callable[[], float] = time.monotonic
    quarantines: int = 0
    readmissions: int = 0
    _records: dict[str, _Record] = field(default_factory=dict)

    def _record(self, name: str) -> _Record:
        found = self._records.get(name)
        if found is None:
            found = self._records[name] = _Record(deque(maxlen=self.settings.window))
        return found

    def observe(
        self,
        endpoint: Endpoint,
        endpoints: Sequence[Endpoint],
        invalid: InvalidAnswerKind | None,
        detail: str = "",
    ) -> Quarantine | None:
        """One answer from ``endpoint`` (``invalid``: why it was unusable, None if it was fine); returns
        a quarantine when this answer tips the window over."""
        record = self._record(endpoint.name)
        record.answers.append(invalid)
        if invalid is None:
            return None
        record.last_detail = detail[:300]
        if endpoint.quarantined or not endpoint.routable:
            return None
        kinds = Counter(kind for kind in record.answers if kind is not None)
        bad = sum(kinds.values())
        cfg = self.settings
        if bad < cfg.min_invalid or bad < cfg.invalid_share * len(record.answers):
            return None
        if not any(e.routable for e in endpoints if e is not endpoint):
            return None  # never the last routable replica
        now = self.clock()
        recently = (
            record.quarantined_at is not None
            and now - record.quarantined_at < 2 * record.cooldown_s + cfg.cooldown_s
        )
        record.cooldown_s = min(cfg.max_cooldown_s, 2 * record.cooldown_s) if recently else cfg.cooldown_s
        record.quarantined_at = now
        self.quarantines += 1
        reason = kinds.most_common(1)[0][0]
        window = len(record.answers)
        text = f"{bad} of its last {window} answers invalid, mostly {reason}: {record.last_detail}"
        log.warning(
            "quarantining replica %s for %.1f s (bad answers): %s", endpoint.name, record.cooldown_s, text
        )
        return Quarantine(endpoint.name, reason, text)

    def probe_due(self, endpoint: Endpoint) -> bool:
        """A quarantined replica whose cool-down is over: time for a probe."""
        record = self._record(endpoint.name)
        return record.quarantined_at is not None and self.clock() - record.quarantined_at >= record.cooldown_s

    def probe_failed(self, endpoint: Endpoint, detail: str) -> None:
        """The probe got no well-formed answer: another cool-down (not doubled: nothing new was sent)."""
        record = self._record(endpoint.name)
        record.quarantined_at = self.clock()
        log.warning("replica %s stays quarantined: probe failed: %s", endpoint.name, detail[:300])

    def probe_passed(self, endpoint: Endpoint) -> None:
        """Re-admitted on probation: the window starts empty, the cool-down is remembered."""
        record = self._record(endpoint.name)
        record.answers.clear()
        self.readmissions += 1
        log.warning("re-admitting replica %s on probation: a probe answered well", endpoint.name)

    def forget(self, endpoint: Endpoint) -> None:
        """The replica left the fleet (``LLMClient.set_endpoints``)."""
        self._records.pop(endpoint.name, None)
