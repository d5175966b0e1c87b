"""How every HTTP service of ours runs: the simulator, the disaggregated router, ``shopper router serve``
and ``shopper realtime serve``. One way, so every launcher can rely on it: listen, print ``READY
http://HOST:PORT`` with the bound port (a service asked for port 0 picks a free one, so no caller ever
guesses or races for a port; ``devstack.served_process`` reads the line), serve until SIGINT or SIGTERM
as an operator stops it, then close the app's connections."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

from aiohttp import web


async def serve_until_stopped(
    app: web.Application,
    host: str,
    port: int,
    *,
    handler_cancellation: bool = False,
    reuse_port: bool | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM. ``handler_cancellation``: a handler whose
    client went away is cancelled (what ``trtllm-serve`` does with a request nobody will read);
    ``on_listening`` runs once the socket is bound, just before the ``READY`` line."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port).start()
        bound = next((address[1] for address in runner.addresses if isinstance(address, tuple)), port)
        if on_listening is not None:
            on_listening()
        print(f"READY http://{host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # not on Windows' event loop
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
