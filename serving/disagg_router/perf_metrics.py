"""``GET /perf_metrics`` of the front end: each disaggregated request's context and generation records,
joined by ``ctx_request_id`` (TensorRT-LLM's ``DisaggPerfMetricsCollector``).

As there: a request is remembered (its servers, ``ctx_request_id`` and the front end's own times) once
its generation answer is done, and only if it went through a context server; a call fetches every
server's ``/perf_metrics`` (which drains it), files each record under its server and
``ctx_request_id`` (at most ``max_requests`` per server, the oldest dropped first), and answers, for
each remembered request whose generation record has arrived, ``ctx_server``, ``gen_server``,
``disagg_server_arrival_time``, ``disagg_server_first_token_time``, ``ctx_perf_metrics`` and
``gen_perf_metrics``; a request whose generation record is not in yet waits for a later call.
``max_requests`` 0 answers nothing.

Every bound drops the oldest entries, never new ones: records nobody will ask for (a context record whose
request finished on the context server or failed on the generation server, a request's record that came
after it was forgotten) age out. The maps used to refuse new records once full, so such orphans, which a
long run always makes, filled them for good, and from then on no request was joined again. A record
without a ``ctx_request_id`` (a request the generation server prefilled itself) can never be joined and is
not filed.

Added here: the front end's other times (``disagg_server_ctx_dispatch_time``, ``..._ctx_done_time``,
``..._last_token_time``; steady-clock seconds, like the two above) and ``timing``, the request's
timeline in the servers' own clock, from their two records alone (no clock alignment needed):

- ``context_time``: the context server's arrival to its first token (queue and prefill);
- ``transfer_time``: the generation server's KV cache transfer, start to end (0 if it moved nothing);
- ``first_token_time`` / ``last_token_time``: ``context_time`` plus the generation server's arrival to
  its first / last token. So ``context_time + transfer_time <= first_token_time <= last_token_time``
  whenever the servers' records are sound; the HTTP hops between the two servers are not in it.

The simulator's servers count simulated seconds (wall seconds / ``time_scale``); a real trtllm-serve's,
steady-clock seconds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DisaggRequestTimes:
    """What the front end remembers of one disaggregated request (steady-clock seconds)."""

    ctx_server: str
    gen_server: str
    ctx_request_id: int
    arrival_time: float
    ctx_dispatch_time: float
    ctx_done_time: float
    first_token_time: float
    last_token_time: float


class DisaggPerfMetrics:
    """The remembered requests and the servers' records not yet matched; pure (the fetch is the
    caller's), so the join is unit-testable."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._requests: deque[DisaggRequestTimes] = deque(maxlen=max_requests)
        self._server_records: dict[str, OrderedDict[int, dict[str, Any]]] = {}
        """Each server's records not joined yet, by ``ctx_request_id``, oldest first."""

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, times: DisaggRequestTimes) -> None:
        if self.max_requests > 0:
            self._requests.append(times)

    def collect(self, fetched: Mapping[str, Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
        """File ``fetched`` (server -> its ``/perf_metrics`` answer) and answer every request whose
        generation record is now known; the others stay for a later call."""
        for server, records in fetched.items():
            kept = self._server_records.setdefault(server, OrderedDict())
            for record in records:
                ctx_request_id = record.get("ctx_request_id")
                if ctx_request_id is None:
                    continue
                kept.pop(ctx_request_id, None)
                kept[ctx_request_id] = record
            while len(kept) > self.max_requests:
                kept.popitem(last=False)
        out: list[dict[str, Any]] = []
        waiting: list[DisaggRequestTimes] = []
        for times in self._requests:
            gen = self._take(times.gen_server, times.ctx_request_id)
            if gen is None:
                waiting.append(times)
                continue
            ctx = self._take(times.ctx_server, times.ctx_request_id)
            out.append(
                {
                    "ctx_server": times.ctx_server,
                    "gen_server": times.gen_server,
                    "ctx_request_id": times.ctx_request_id,
                    "disagg_server_arrival_time": times.arrival_time,
                    "disagg_server_ctx_dispatch_time": times.ctx_dispatch_time,
                    "disagg_server_ctx_done_time": times.ctx_done_time,
                    "disagg_server_first_token_time": times.first_token_time,
                    "disagg_server_last_token_time": times.last_token_time,
                    "ctx_perf_metrics": ctx,
                    "gen_perf_metrics": gen,
                    "timing": request_timing(ctx, gen),
                }
            )
        self._requests = deque(waiting, maxlen=self.max_requests)
        return out

    def _take(self, server: str, ctx_request_id: int) -> dict[str, Any] | None:
        """Remove and return ``server``'s record of ``ctx_request_id``, if it has one."""
        kept = self._server_records.get(server)
        return None if kept is None else kept.pop(ctx_request_id, None)


def request_timing(ctx: dict[str, Any] | None, gen: dict[str, Any]) -> dict[str, float] | None:
    """The ``timing`` summary (see the module's docstring); None without the context record."""
    if ctx is None:
        return None
    c = ctx["perf_metrics"]["timing_metrics"]
    g = gen["perf_metrics"]["timing_metrics"]
    context = c["first_token_time"] - c["arrival_time"]
    start, end = g.get("kv_cache_transfer_start"), g.get("kv_cache_transfer_end")
    transfer = end - start if start is not None and end is not None else 0.0
    return {
        "context_time": context,
        "transfer_time": transfer,
        "first_token_time": context + g["first_token_time"] - g["arrival_time"],
        "last_token_time": context + g["last_token_time"] - g["arrival_time"],
    }
