"""``shopper realtime``: serve the real-time matching API, print or refresh its OpenAPI spec.

Addresses come from the embedded stack's state file unless ``--no-from-stack`` is given (then
``SINK_*`` and ``LLM_*`` variables apply). Service settings come from ``REALTIME_*`` variables.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

realtime_app = typer.Typer(no_args_is_help=True, help="Real-time shopper-product matching service.")

StateDir = Annotated[Path, typer.Option(help="the embedded stack's state directory")]


@realtime_app.command("serve")
def serve_cmd(
    port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="listen port (0 = a free one); default REALTIME_PORT"),
    ] = None,
    replicas: Annotated[
        int | None, typer.Option(help="use only the first N of the stack's LLM replicas (the real-time pool)")
    ] = None,
    shift_capacity: Annotated[
        str | None,
        typer.Option(
            help="pool name: share all replicas with batch and shift them by load (CAPACITY_* settings); "
            "batch workers join with --follow-pool NAME"
        ),
    ] = None,
    state_dir: StateDir = Path(".state"),
    from_stack: Annotated[bool, typer.Option(help="take addresses from the stack state file")] = True,
) -> None:
    """Serve POST /v1/match, /health, /metrics and /openapi.json until SIGINT/SIGTERM."""
    from llm_client.config import ClientConfig
    from pipeline.kafka_security import settings_from_environment
    from pipeline.redaction import redacted_config_dump
    from realtime.config import RealtimeSettings
    from realtime.service import realtime_client_config
    from sinks.config import SinkSettings

    # Each read from its variables; a value refused is one line naming the setting (not a traceback).
    given: dict[str, Any] = {} if port is None else {"port": port}  # the option wins over REALTIME_PORT
    settings = settings_from_environment(RealtimeSettings, **given)
    env = settings_from_environment(ClientConfig)  # LLM_*: endpoints (without the stack), key, CA bundle
    if from_stack:
        from devstack.stack import load_state, sink_settings

        state = load_state(state_dir)
        sinks = sink_settings(state)
        endpoints, model = state.llm_endpoints, state.model
    else:
        sinks = settings_from_environment(SinkSettings)
        endpoints, model = env.endpoints, env.model
    llm = realtime_client_config(
        endpoints[:replicas] if replicas else endpoints, model, security=env.security
    )
    config: dict[str, object] = {"realtime": settings, "llm": llm, "sinks": sinks}
    capacity = None
    if shift_capacity:
        from capacity.controller import CapacitySettings

        capacity = settings_from_environment(CapacitySettings)
        config["capacity"] = {"pool": shift_capacity, **capacity.model_dump()}
    print(redacted_config_dump(config), flush=True)  # secrets masked (pipeline.redaction)
    run_event_loop(_serve(settings, llm, sinks, shift_capacity, capacity), settings.event_loop)


def run_event_loop(main: Coroutine[Any, Any, None], kind: str) -> None:
    """``asyncio.run(main)`` on the loop ``kind`` names: ``uvloop`` where it is installed (it is a
    dependency except on Windows, where it does not exist), else the standard library's."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("uvloop is not installed: serving on the standard asyncio loop", flush=True)
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


async def _serve(
    settings: object, llm: object, sinks: object, pool_name: str | None, capacity: object
) -> None:
    from realtime.service import create_app
    from serving.http_service import serve_until_stopped

    app = create_app(settings, llm_config=llm, sinks=sinks)  # type: ignore[arg-type]
    if pool_name:
        from capacity.pool import SharedPool
        from realtime.shifting import enable_capacity_shifting

        enable_capacity_shifting(app, SharedPool(pool_name, llm.endpoints), capacity)  # type: ignore[attr-defined,arg-type]

    def freeze_and_announce() -> None:
        # Everything built so far (modules, settings, the app) lives as long as the process: frozen out
        # of the collector, a full collection no longer walks it (the collector was ~6% of the CPU under
        # load).
        gc.collect()
        gc.freeze()
        print(f"event loop: {type(asyncio.get_running_loop()).__module__}", flush=True)

    # A caller that leaves cancels its handler: its model call is cut and its concurrency slot freed
    # at once, not held (and the answer written to nobody) until the deadline.
    await serve_until_stopped(
        app,
        settings.host,  # type: ignore[attr-defined]
        settings.port,  # type: ignore[attr-defined]
        handler_cancellation=True,
        on_listening=freeze_and_announce,
    )


@realtime_app.command("openapi")
def openapi_cmd(write: Annotated[bool, typer.Option(help="rewrite realtime/openapi.json")] = False) -> None:
    """Print the OpenAPI spec (or refresh the checked-in copy)."""
    from realtime.openapi import openapi_spec, write_spec

    if write:
        typer.echo(f"wrote {write_spec()}")
    else:
        typer.echo(json.dumps(openapi_spec(), indent=2, sort_keys=True))
