"""``shopper batch``: submit, watch, cancel and resume product-understanding jobs.

Addresses (Redis, S3, LLM endpoints) come from the embedded stack's state file unless
``--no-from-stack`` is given, in which case ``SINK_*`` and ``LLM_*`` variables apply, as for
``shopper run``. Batch settings come from ``BATCH_*`` variables (see ``batch.config``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sinks.keys import RedisKeys

if TYPE_CHECKING:
    from llm_client.client import LLMClient

batch_app = typer.Typer(
    no_args_is_help=True, help="Batch product understanding: S3 JSONL in, S3 JSONL + Redis out."
)
console = Console(width=None if sys.stdout.isatty() else 150)

StateDir = Annotated[Path, typer.Option(help="the embedded stack's state directory")]
FromStack = Annotated[bool, typer.Option(help="take addresses from the stack state file")]
FollowPool = Annotated[
    str | None,
    typer.Option(help="share the replicas with a real-time service run with --shift-capacity NAME"),
]


def _environment(state_dir: Path, from_stack: bool) -> tuple[Any, Any, Any]:
    from batch.config import BatchSettings
    from batch.launch import batch_client_config
    from pipeline.kafka_security import settings_from_environment

    # Each read from its variables; a value refused is one line naming the setting (not a traceback).
    settings = settings_from_environment(BatchSettings)
    if from_stack:
        from devstack.stack import load_state, sink_settings

        state = load_state(state_dir)
        sinks = sink_settings(state)
        llm = batch_client_config(state.llm_endpoints, state.model, settings)
    else:
        from llm_client.config import ClientConfig
        from sinks.config import SinkSettings

        sinks = settings_from_environment(SinkSettings)
        env = settings_from_environment(ClientConfig)
        llm = batch_client_config(env.endpoints, env.model, settings)
    return settings, sinks, llm


@contextlib.asynccontextmanager
async def _job_store(sinks: Any, jobs_prefix: str, from_stack: bool) -> AsyncIterator[Any]:
    """The job store of a command that registers or reads jobs (submit, resume, cancel, status), whose
    first S3 call is its first contact: an endpoint where nothing answers ends it with one line naming
    the setting and the endpoint (``S3Unreachable``). A worker's own S3 calls are not in here: their
    failures are retried, then fail the job, which resumes later (``batch.job_run``)."""
    from botocore.exceptions import EndpointConnectionError

    from batch.storage import JobStore
    from sinks.errors import S3Unreachable

    try:
        async with JobStore(sinks, jobs_prefix) as store:
            yield store
    except EndpointConnectionError as exc:
        setting = (
            "the stack's S3 (its state file: STACK_S3_ENDPOINT_URL at 'shopper stack up', else its moto)"
            if from_stack
            else "SINK_S3_ENDPOINT_URL"
        )
        raise S3Unreachable(setting, sinks.s3_endpoint_url, exc) from exc


@batch_app.command("submit")
def submit_cmd(
    input_uri: Annotated[str, typer.Option("--input", help="s3://bucket/products.jsonl")],
    output_uri: Annotated[str, typer.Option("--output", help="s3://bucket/prefix for parts and errors")],
    priority: Annotated[int, typer.Option(help="higher runs first and takes the pool's slots first")] = 0,
    job_id: Annotated[str | None, typer.Option(help="default: a new time-stamped id")] = None,
    shard_records: Annotated[int | None, typer.Option(help="lines per output part (unit of resume)")] = None,
    detach: Annotated[
        bool, typer.Option(help="only register the job; 'shopper batch worker' runs it")
    ] = False,
    fixed_concurrency: Annotated[
        int | None, typer.Option(min=1, help="disable AIMD; use this many calls")
    ] = None,
    follow_pool: FollowPool = None,
    state_dir: StateDir = Path(".state"),
    from_stack: FromStack = True,
) -> None:
    """Register a job and (unless --detach) run it here with a progress bar."""
    settings, sinks, llm = _environment(state_dir, from_stack)

    async def main() -> int:
        from batch.admin import submit_job

        async with _job_store(sinks, settings.jobs_prefix, from_stack) as store:
            manifest = await submit_job(
                store,
                input_uri,
                output_uri,
                priority=priority,
                shard_records=shard_records or settings.shard_records,
                job_id=job_id,
            )
        console.print(f"submitted [bold]{manifest.job_id}[/bold] (priority {priority})")
        if detach:
            return 0
        return await _run_worker(
            settings,
            sinks,
            llm,
            [manifest.job_id],
            fixed_concurrency=fixed_concurrency,
            follow_pool=follow_pool,
        )

    raise typer.Exit(asyncio.run(main()))


@batch_app.command("resume")
def resume_cmd(
    job_id: str,
    detach: Annotated[
        bool, typer.Option(help="only mark it runnable; 'shopper batch worker' runs it")
    ] = False,
    fixed_concurrency: Annotated[
        int | None, typer.Option(min=1, help="disable AIMD; use this many calls")
    ] = None,
    follow_pool: FollowPool = None,
    state_dir: StateDir = Path(".state"),
    from_stack: FromStack = True,
) -> None:
    """Resume a killed, failed, interrupted or cancelled job: committed shards are not redone.

    If the killed worker's lease is still live, waits for it to expire (BATCH_LEASE_TTL_S).
    """
    settings, sinks, llm = _environment(state_dir, from_stack)

    async def main() -> int:
        from batch.admin import prepare_resume

        async with _job_store(sinks, settings.jobs_prefix, from_stack) as store:
            manifest = await prepare_resume(store, job_id)
        console.print(f"resuming [bold]{job_id}[/bold]: {manifest.records_done} records already committed")
        if detach:
            return 0
        return await _run_worker(
            settings, sinks, llm, [job_id], fixed_concurrency=fixed_concurrency, follow_pool=follow_pool
        )

    raise typer.Exit(asyncio.run(main()))


@batch_app.command("worker")
def worker_cmd(
    follow: Annotated[bool, typer.Option(help="keep polling for new jobs until interrupted")] = False,
    follow_pool: FollowPool = None,
    state_dir: StateDir = Path(".state"),
    from_stack: FromStack = True,
) -> None:
    """Run every queued or resumable job, by priority, sharing the pool."""
    settings, sinks, llm = _environment(state_dir, from_stack)
    raise typer.Exit(
        asyncio.run(_run_worker(settings, sinks, llm, None, follow=follow, follow_pool=follow_pool))
    )


@batch_app.command("cancel")
def cancel_cmd(job_id: str, state_dir: StateDir = Path(".state"), from_stack: FromStack = True) -> None:
    """Ask the job's worker to stop (complete shards are kept; 'resume' continues it)."""
    settings, sinks, _ = _environment(state_dir, from_stack)

    async def main() -> None:
        from batch.admin import cancel_job

        redis = sinks.redis_client()
        try:
            async with _job_store(sinks, settings.jobs_prefix, from_stack) as store:
                manifest = await cancel_job(store, redis, sinks.redis_key_prefix, job_id)
        finally:
            await redis.aclose()
        done = "cancelled" if manifest.state == "cancelled" else "cancellation requested"
        console.print(f"{job_id}: {done}")

    asyncio.run(main())


@batch_app.command("status")
def status_cmd(
    job_id: Annotated[str | None, typer.Argument(help="one job; none = every job")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    state_dir: StateDir = Path(".state"),
    from_stack: FromStack = True,
) -> None:
    """A job's manifest and live progress, or a table of every job."""
    settings, sinks, _ = _environment(state_dir, from_stack)

    async def main() -> list[dict[str, Any]]:
        from batch.coordination import read_progress

        redis = sinks.redis_client()
        try:
            async with _job_store(sinks, settings.jobs_prefix, from_stack) as store:
                manifests = [await store.read_manifest(job_id)] if job_id else await store.list_manifests()
                rows = []
                for m in manifests:
                    row = m.summary()
                    row["live"] = await read_progress(redis, sinks.redis_key_prefix, m.job_id)
                    holder = await redis.get(RedisKeys(sinks.redis_key_prefix).batch_lease(m.job_id))
                    row["worker"] = holder.decode() if holder else None
                    rows.append(row)
                return rows
        finally:
            await redis.aclose()

    rows = asyncio.run(main())
    if as_json or job_id:
        console.print_json(json.dumps(rows[0] if job_id else rows))
        return
    table = Table("job", "state", "prio", "done", "total", "failed", "rate/s", "worker")
    for row in rows:
        live = row["live"] or {}
        state = row["state"]
        if state == "running" and not row["worker"]:
            state = "running (no worker: resume it)"
        table.add_row(
            row["job_id"],
            state,
            str(row["priority"]),
            str(live.get("done", row["records_done"])),
            str(live.get("total") or row["records_total"] or "?"),
            str(row["records_failed"]),
            f"{live['rate']:.0f}" if live else "-",
            row["worker"] or "-",
        )
    console.print(table)


async def _run_worker(
    settings: Any,
    sinks: Any,
    llm: Any,
    job_ids: list[str] | None,
    *,
    follow: bool = False,
    fixed_concurrency: int | None = None,
    follow_pool: str | None = None,
) -> int:
    """Run a worker with a progress display; 0 when every job succeeded."""
    from batch.launch import open_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    console.print(f"[dim]batch settings: {settings.model_dump_json()}[/dim]")
    async with open_batch(settings, sinks, llm, fixed_limit=fixed_concurrency) as runtime:
        await wait_for_first_replica(runtime.client)
        follower = None
        if follow_pool:
            from capacity.controller import CapacitySettings
            from capacity.pool import PoolBoard, PoolFollower, SharedPool

            board = PoolBoard(runtime.redis, sinks.redis_key_prefix, SharedPool(follow_pool, llm.endpoints))
            follower = PoolFollower(
                board, "batch", runtime.pool.set_endpoints, handoff_s=CapacitySettings().handoff_s
            )
            await follower.sync()
            follower.start()
        worker = runtime.worker()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, worker.interrupt)
        display = asyncio.create_task(_show_progress(worker))
        try:
            results = await worker.run(job_ids, follow=follow)
        finally:
            display.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await display
            if follower is not None:
                await follower.stop()
    for m in results:
        colour = {"succeeded": "green", "failed": "red"}.get(m.state, "yellow")
        console.print(
            f"[{colour}]{m.job_id}: {m.state}[/{colour}] {m.records_ok} ok, {m.records_failed} errors, "
            f"{m.requests} LLM calls" + (f" ({m.message})" if m.message else "")
        )
        if m.errors_uri and m.records_failed:
            console.print(f"  errors: {m.errors_uri}")
    return 0 if results and all(m.state == "succeeded" for m in results) else 1


async def _show_progress(worker: Any, interval_s: float = 5.0) -> None:
    """A rich progress bar per job on a terminal; one log line per job every ``interval_s`` otherwise."""
    if not sys.stdout.isatty():
        while True:
            await asyncio.sleep(interval_s)
            for job in list(worker.active.values()):
                p = job.progress()
                eta = f"{p['eta_s']:.0f} s" if p["eta_s"] is not None else "?"
                console.print(
                    f"{time.strftime('%H:%M:%S')} {p['job_id']}: {p['done']}/{p['total'] or '?'} records, "
                    f"{p['rate']:.0f}/s, ETA {eta}, limit {p['limit']}, in flight {p['in_flight']}, "
                    f"errors {p['errors']}"
                )
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>7.0f} rec/s  ETA {task.fields[eta]:>6}  limit {task.fields[limit]}"),
        TextColumn("errors {task.fields[errors]}"),
    )
    with Progress(*columns, console=console, refresh_per_second=4) as bar:
        tasks: dict[str, Any] = {}
        while True:
            for job in list(worker.active.values()):
                p = job.progress()
                eta = f"{p['eta_s']:.0f}s" if p["eta_s"] is not None else "?"
                fields = {"rate": p["rate"], "eta": eta, "limit": p["limit"], "errors": p["errors"]}
                if job.job_id not in tasks:
                    tasks[job.job_id] = bar.add_task(job.job_id, total=p["total"], **fields)
                bar.update(tasks[job.job_id], completed=p["done"], total=p["total"], **fields)
            await asyncio.sleep(0.5)


async def wait_for_first_replica(client: LLMClient, timeout_s: float = 30.0) -> None:
    """Until one LLM replica answers ``/health``: a fleet always has one down somewhere, and waiting
    for every replica kept the worker from starting at all (a traceback after 30 s). The others are
    named, and the client's health loop admits each as it answers."""
    from llm_client.errors import NoHealthyEndpoint

    try:
        await client.wait_until_healthy(timeout_s, minimum=1)
    except TimeoutError:
        urls = ", ".join(e.url for e in client.endpoints)
        raise NoHealthyEndpoint(f"no LLM replica answered /health within {timeout_s:.0f} s: {urls}") from None
    down = [e.url for e in client.endpoints if not e.healthy]
    if down:
        logging.getLogger(__name__).warning(
            "%d of %d LLM replicas not answering /health yet, started without them: %s",
            len(down),
            len(client.endpoints),
            ", ".join(down),
        )
