"""Replaying a trace through ``LLMClient`` against simulated replicas or llama-server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from bench.routing.fleet import SimFleet, _kill_later, _reset_later, engine_flags
from bench.routing.stats import (
    Outcome,
    RunResult,
    _after_reset,
    _kill_report,
    _pct,
    server_tail_report,
    summarise,
    tail_report,
    windows,
)
from bench.trace import (
    OracleBound,
    TraceRequest,
    with_poisson_arrivals,
)
from llm_client import ClientConfig, LLMClient
from llm_client.errors import LLMError
from llm_client.hooks import Attempt
from llm_client.routing.prefix_aware import PrefixAwarePolicy, PrefixAwareSettings


def client_config(
    urls: Sequence[str],
    policy: str,
    *,
    attempt_s: float,
    deadline_s: float,
    options: dict[str, Any] | None = None,
    time_scale: float = 1.0,
) -> ClientConfig:
    """``policy`` is a policy name, ``prefix_aware_precise`` (prefix_aware following KV events) or
    ``prefix_aware_noguard`` (without the tail guards: hot-shopper spreading and the queue cap, as before
    they existed) or ``prefix_aware_spread`` (with hot-shopper spreading, off by default) or
    ``prefix_aware_room`` (with ``kv_room_guard``, off by default), any of them followed by
    ``/setting=value`` pieces (``prefix_aware/load_factor=1.25``: an ablation run beside the default in
    one sweep, on the same trace and arrivals; values are JSON); ``options``
    are prefix_aware's settings (ignored for the others), passed as they are (a ``cobatch_window_s``
    there is wall time); ``time_scale`` is the replicas' (wall seconds per simulated second)."""
    settings: dict[str, Any] | None = None
    policy, *pieces = policy.split("/")
    overrides = {key: json.loads(value) for key, value in (piece.split("=", 1) for piece in pieces)}
    if overrides and not policy.startswith("prefix_aware"):
        raise ValueError(f"/setting=value applies to prefix_aware's settings, not to {policy}")
    if policy.startswith("prefix_aware"):
        # The co-batching window is engine time: a simulated second lasts time_scale wall seconds.
        window = PrefixAwareSettings().cobatch_window_s * time_scale
        settings = {"cobatch_window_s": window, **(options or {}), "policy": "prefix_aware"}
        if policy == "prefix_aware_precise":
            settings["kv_events"] = "precise"
        if policy == "prefix_aware_noguard":
            settings.update(max_queued_tokens=1e12, hot_key_spread=False)
        if policy == "prefix_aware_spread":
            settings["hot_key_spread"] = True
        if policy == "prefix_aware_room":
            settings["kv_room_guard"] = True
        settings.update(overrides)
        policy = "prefix_aware"
    return ClientConfig.model_validate(
        {
            "endpoints": list(urls),
            "policy": policy,
            "policy_settings": settings,
            "model": "bench",
            "max_in_flight": 4096,
            "stream": True,
            "timeouts": {"connect_s": 5.0, "attempt_s": attempt_s, "deadline_s": deadline_s},
            "health": {"interval_s": 0.5},
        }
    )


async def replay(
    client: LLMClient,
    trace: Sequence[TraceRequest],
    time_scale: float,
    *,
    sequential_per_shopper: bool = False,
    concurrency: int | None = None,
    extra_body: dict[str, Any] | None = None,
    on_progress: Any = None,
) -> list[Outcome]:
    """Send each request at its arrival time (simulated seconds x ``time_scale``); with
    ``sequential_per_shopper`` a shopper's next prompt also waits for its previous answer (closed loop)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    previous: dict[str, asyncio.Task[Outcome]] = {}

    async def one(request: TraceRequest, after: asyncio.Task[Outcome] | None) -> Outcome:
        if after is not None:
            await asyncio.wait([after])
        async with gate if gate is not None else contextlib.nullcontext():
            start = loop.time()
            arrival = (start - t0) / time_scale
            try:
                c = await client.chat(
                    request.messages,
                    routing_key=request.shopper_id,
                    max_tokens=request.max_tokens,
                    extra_body=extra_body,
                )
            except LLMError as exc:
                end = loop.time()
                return Outcome(request.shopper_id, arrival, (end - t0) / time_scale, False, error=repr(exc))
            end = loop.time()
            e2e = (end - start) * 1000.0
            ttft = e2e - (c.latency_ms - c.ttft_ms)  # includes retries and client-side time
            outcome = Outcome(
                request.shopper_id,
                arrival,
                (end - t0) / time_scale,
                True,
                ttft / time_scale,
                e2e / time_scale,
                c.endpoint,
                c.prompt_tokens,
                c.cached_tokens,
                c.attempts,
            )
            if on_progress is not None:
                on_progress(outcome)
            return outcome

    tasks: list[asyncio.Task[Outcome]] = []
    for request in trace:
        delay = t0 + request.t * time_scale - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        after = previous.get(request.shopper_id) if sequential_per_shopper else None
        task = asyncio.create_task(one(request, after))
        previous[request.shopper_id] = task
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


# ---- setups ----------------------------------------------------------------------------------------
async def run_sim(
    policy: str,
    utilisation: float,
    trace: Sequence[TraceRequest],
    capacity_rps: float,
    oracle: OracleBound,
    args: argparse.Namespace,
    *,
    kill_at_fraction: float | None = None,
    timed: Sequence[TraceRequest] | None = None,
    fleet_args: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    reset_at_fraction: float | None = None,
    setup: str = "sim",
) -> tuple[RunResult, list[Outcome]]:
    """One replay on fresh replicas. ``timed``: the arrivals (default: Poisson at ``utilisation``);
    ``fleet_args``: extra simulator flags; ``options``: prefix_aware settings (default: the command
    line's); ``reset_at_fraction``: empty replica ``args.kill_replica``'s cache when that share of the
    prompts has arrived (a restart that keeps the process)."""
    if timed is None:
        timed = with_poisson_arrivals(trace, utilisation * capacity_rps, seed=args.seed)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    fleet_args = [*engine_flags(args), *fleet_args]
    async with SimFleet(args.replicas, args.time_scale, args.coalesce_s, fleet_args) as fleet:
        config = client_config(
            fleet.urls,
            policy,
            attempt_s=120 * args.time_scale + 10,
            deadline_s=300 * args.time_scale + 20,
            options=options if options is not None else json.loads(args.prefix_aware_options),
            time_scale=args.time_scale,
        )
        async with LLMClient(config, seed=args.seed) as client:
            await client.wait_until_healthy()
            attempt_errors = _count_attempt_errors(client)
            killer = resetter = None
            if kill_at_fraction is not None:
                kill_time = timed[int(len(timed) * kill_at_fraction)].t
                killer = asyncio.create_task(
                    _kill_later(fleet, client, args.kill_replica, kill_time * args.time_scale)
                )
            if reset_at_fraction is not None:
                reset_time = timed[int(len(timed) * reset_at_fraction)].t
                resetter = asyncio.create_task(
                    _reset_later(fleet, args.kill_replica, reset_time * args.time_scale)
                )
            outcomes = await replay(client, timed, args.time_scale, extra_body={"ignore_eos": True})
            eject_delay_s = (await killer) / args.time_scale if killer is not None else None
            if resetter is not None:
                await resetter
            stats = await fleet.stats()
            server_ttft = await fleet.server_ttft_ms()
            first_tokens = await fleet.server_first_tokens()
            server_ttfts = sorted(float(r["ttft_ms"]) for r in first_tokens)
            result = summarise(
                setup,
                policy,
                utilisation,
                outcomes,
                client,
                oracle,
                stats,
                time.perf_counter() - started,
                server_ttft,
            )
            # Other work on the machine distorts the replicas' clocks: keep the evidence with the result.
            result.extra["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            result.extra["attempt_errors"] = dict(attempt_errors)
            result.extra["windows"] = windows(outcomes)
            result.extra["tail"] = tail_report(outcomes, timed)
            result.extra["server_tail"] = server_tail_report(first_tokens)
            if server_ttfts:
                result.server_ttft_p50_ms = _pct(server_ttfts, 50)
                result.server_ttft_p99_ms = _pct(server_ttfts, 99)
                result.extra["server_ttfts_ms"] = [round(t, 1) for t in server_ttfts]
            if isinstance(client.policy, PrefixAwarePolicy):
                result.extra["policy_stats"] = asdict(client.policy.stats)
            if reset_at_fraction is not None:
                reset_s = timed[int(len(timed) * reset_at_fraction)].t
                result.extra["reset_at_s"] = reset_s
                result.extra["after_reset"] = _after_reset(
                    outcomes, reset_s, client.endpoints[args.kill_replica].name
                )
            if kill_at_fraction is not None:
                kill_s = timed[int(len(timed) * kill_at_fraction)].t
                result.extra.update(_kill_report(outcomes, kill_s, client, args))
                result.extra["ejected_after_s"] = eject_delay_s
    return result, outcomes


def _count_attempt_errors(client: LLMClient) -> Counter[str]:
    """Count why attempts failed (the client retries them silently), through the client's hooks."""
    errors: Counter[str] = Counter()

    def failed(attempt: Attempt, exc: LLMError) -> None:
        errors[f"{type(exc).__name__}: {str(exc)[:60]}"] += 1

    client.hooks.attempt_failed.append(failed)
    return errors


async def run_llama(
    policy: str, trace: Sequence[TraceRequest], oracle: OracleBound, args: argparse.Namespace
) -> RunResult:
    from devstack.llama import LlamaReplica, ensure_gemma_model, ensure_llama_binary

    binary, model = ensure_llama_binary(), ensure_gemma_model()
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                LlamaReplica(
                    binary=binary, model_path=model, parallel=2, threads=1, ctx_size=8192, cache_ram_mib=256
                )
            )
            for _ in range(args.llama_replicas)
        ]
        config = client_config(
            [r.url for r in replicas],
            policy,
            attempt_s=300,
            deadline_s=600,
            options=json.loads(args.prefix_aware_options),
        )
        async with LLMClient(config, seed=args.seed) as client:
            await client.wait_until_healthy(60)
            # closed loop: a shopper's next prompt waits for its previous answer, few in flight
            at_once = [replace(r, t=0.0) for r in trace]
            outcomes = await replay(
                client, at_once, 1.0, sequential_per_shopper=True, concurrency=args.llama_replicas
            )
            result = summarise(
                "llama", policy, 0.0, outcomes, client, oracle, None, time.perf_counter() - started
            )
    oracle_share = 1 - oracle.prefill_tokens_per_shopper / oracle.prompt_tokens
    result.extra["oracle_cached_share"] = oracle_share
    result.extra["cached_share_vs_oracle"] = result.cache_hit_ratio / oracle_share if oracle_share else 0.0
    return result
