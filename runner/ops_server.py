"""The runner's operations endpoint: ``/metrics`` (Prometheus text format), ``/health/live`` and
``/health/ready`` (200 or 503, with a JSON body saying why), ``/health`` (= ready).

It runs on the runner's own event loop (aiohttp), so a loop that stops answering fails liveness, which
is the point. Off unless ``metrics_port`` is set; port 0 takes a free port (``address`` says which).
Bind to 127.0.0.1 by default; a container sets ``RUNNER_METRICS_HOST=0.0.0.0``.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from runner.health import RunnerView, readiness
from runner.metrics import RunnerMetrics


class OpsServer:
    def __init__(self, view: RunnerView, metrics: RunnerMetrics, *, host: str, port: int) -> None:
        self.view = view
        self.metrics = metrics
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health/live", self._live)
        app.router.add_get("/health/ready", self._ready)
        app.router.add_get("/health", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the real port when 0 was asked for

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _live(self, _: web.Request) -> web.Response:
        report = readiness(self.view)
        return web.json_response(report.model_dump(), status=200 if report.live else 503)

    async def _ready(self, _: web.Request) -> web.Response:
        report = readiness(self.view)
        return web.json_response(report.model_dump(), status=200 if report.ready else 503)
