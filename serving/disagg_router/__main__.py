"""``python -m serving.disagg_router --config <disagg yaml> [--port N]``: serve until SIGINT/SIGTERM.

Prints the configuration it runs with, then ``READY http://HOST:PORT`` once it listens (``--port 0``
binds a free port). Host and port default to the YAML's ``hostname`` and ``port``.
"""

from __future__ import annotations

import argparse
import asyncio

from serving.disagg_router.app import create_app
from serving.disagg_router.config import DisaggConfig
from serving.http_service import serve_until_stopped


async def serve(config: DisaggConfig, host: str, port: int, request_timeout_s: float) -> None:
    app = create_app(config, request_timeout_s=request_timeout_s)
    await serve_until_stopped(app, host, port, handler_cancellation=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.disagg_router", description=__doc__)
    parser.add_argument("--config", required=True, help="the trtllm-serve disaggregated YAML")
    parser.add_argument("--host", help="default: the YAML's hostname")
    parser.add_argument("--port", type=int, help="default: the YAML's port")
    parser.add_argument("--context-urls", nargs="+", help="replace the YAML's context server URLs")
    parser.add_argument("--generation-urls", nargs="+", help="replace the YAML's generation server URLs")
    parser.add_argument(
        "--perf-metrics-max-requests", type=int, help="replace the YAML's (0 there: /perf_metrics off)"
    )
    parser.add_argument("--request-timeout", type=float, default=180.0, help="seconds per worker request")
    args = parser.parse_args()
    overrides = {}
    if args.perf_metrics_max_requests is not None:
        overrides["perf_metrics_max_requests"] = args.perf_metrics_max_requests
    config = DisaggConfig.load(args.config).with_overrides(
        context_urls=args.context_urls, generation_urls=args.generation_urls, **overrides
    )
    print(config.model_dump_json(indent=1), flush=True)
    host = args.host or config.hostname
    port = config.port if args.port is None else args.port
    asyncio.run(serve(config, host, port, args.request_timeout))


if __name__ == "__main__":
    main()
