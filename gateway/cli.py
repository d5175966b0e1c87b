"""``shopper router``: run the routing gateway in front of the LLM replicas.

Replicas come from ``--endpoint`` flags, else the embedded stack's state file (``--from-stack``), else
``LLM_ENDPOINTS``; every other client setting (timeouts, retries, health, policy options) from ``LLM_*``
variables, the gateway's own from ``GATEWAY_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Annotated, Any

import typer

router_app = typer.Typer(
    no_args_is_help=True, help="OpenAI-compatible routing gateway in front of the replicas."
)


@router_app.command("serve")
def serve_cmd(
    endpoint: Annotated[
        list[str] | None,
        typer.Option(help="replica base URL (repeat); default: the stack's or LLM_ENDPOINTS"),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="round_robin, least_outstanding, session_affinity, prefix_aware, pd_aware or predicted_ttft "
            "[default: LLM_POLICY or prefix_aware]"
        ),
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="listen port (0 = a free one) [default: GATEWAY_PORT]")
    ] = None,
    host: Annotated[str | None, typer.Option(help="listen address [default: GATEWAY_HOST]")] = None,
    from_stack: Annotated[
        bool, typer.Option(help="take replicas and model from the stack state file")
    ] = False,
    state_dir: Annotated[Path, typer.Option(help="the embedded stack's state directory")] = Path(".state"),
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics until SIGINT/SIGTERM;
    prints the settings as one JSON line, then ``READY http://HOST:PORT``."""
    from gateway.app import serve
    from gateway.config import GatewaySettings
    from llm_client.config import ClientConfig
    from pipeline.redaction import redacted_config_dump

    gateway_overrides: dict[str, Any] = {}
    if port is not None:
        gateway_overrides["port"] = port
    if host is not None:
        gateway_overrides["host"] = host
    settings = GatewaySettings(**gateway_overrides)
    client_overrides: dict[str, Any] = {}
    if from_stack:
        from devstack.stack import load_state

        state = load_state(state_dir)
        client_overrides.update(endpoints=state.llm_endpoints, model=state.model)
    if endpoint:
        client_overrides["endpoints"] = endpoint
    if policy is not None:
        client_overrides["policy"] = policy
    client_config = ClientConfig(**client_overrides)
    # endpoint URLs may carry user:password@, the API keys are secrets: printed masked
    print(redacted_config_dump({"gateway": settings, "llm": client_config}), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, client_config))
