"""GET /metrics: the runtime's Prometheus registry (counts and timings only, no prompt data)."""

from __future__ import annotations

from aiohttp import web

from flare_core.server.state import STATE


async def metrics(request: web.Request) -> web.Response:
    engine_metrics = request.app[STATE].engine.metrics
    return web.Response(body=engine_metrics.render(), headers={"Content-Type": engine_metrics.content_type})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)
