"""Test-only admin routes: change faults at run time, drop the KV cache, read counters.

A real trtllm-serve has none of these; tests and benchmarks use them to make one replica slow or failing
mid-run, or to simulate a restart that lost the cache, without restarting the process.
"""

from __future__ import annotations

from dataclasses import asdict

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.simulator.bad_answers import BadAnswer
from serving.simulator.protocol import error_body
from serving.simulator.replica import REPLICA_KEY


class FaultUpdate(BaseModel):
    """Body of ``POST /admin/config``; omitted fields keep their value."""

    model_config = ConfigDict(extra="forbid")
    slowdown: float | None = Field(default=None, gt=0.0)
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    bad_answer: BadAnswer | None = None
    bad_answer_rate: float | None = Field(default=None, ge=0.0, le=1.0)


def add_admin_routes(app: web.Application) -> None:
    app.router.add_post("/admin/config", _update_config)
    app.router.add_post("/admin/reset_cache", _reset_cache)
    app.router.add_get("/admin/stats", _stats)
    app.router.add_get("/admin/ttft", _ttft)


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _update_config(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    try:
        update = FaultUpdate.model_validate(orjson.loads(await request.read() or b"{}"))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        return _json(error_body(str(exc), "invalid_request_error", 400), status=400)
    if update.slowdown is not None:
        replica.knobs.slowdown = update.slowdown
    if update.error_rate is not None:
        replica.error_rate = update.error_rate
    if update.bad_answer is not None:
        replica.bad_answer = update.bad_answer
    if update.bad_answer_rate is not None:
        replica.bad_answer_rate = update.bad_answer_rate
    return _json(
        {
            "slowdown": replica.knobs.slowdown,
            "error_rate": replica.error_rate,
            "bad_answer": replica.bad_answer,
            "bad_answer_rate": replica.bad_answer_rate,
        }
    )


async def _reset_cache(request: web.Request) -> web.Response:
    """Drop every unpinned block; ``kv_blocks_used`` is what requests in flight still hold (0 when idle)."""
    replica = request.app[REPLICA_KEY]
    replica.reset_cache()
    return _json({"status": "ok", "kv_blocks_used": replica.cache.used_blocks})


async def _stats(request: web.Request) -> web.Response:
    return _json(request.app[REPLICA_KEY].stats())


async def _ttft(request: web.Request) -> web.Response:
    """Every finished request's TTFT in simulated ms since the last call (exact server-side tails), and
    each one's timeline (``FirstTokenRecord``) in ``requests``, to tell queueing from prefill."""
    records = request.app[REPLICA_KEY].drain_first_tokens()
    return _json({"ttft_ms": [r.ttft_ms for r in records], "requests": [asdict(r) for r in records]})
