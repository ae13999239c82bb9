"""``kvmesh dashboard``: the dashboard on its own, read-only, without a router.

``create_app(settings)`` builds the page's routes (``app.dashboard.api``) and the cluster's
read-only ones (``/workers``, ``/index/stats``, ``/health``, ``/ready``, ``/metrics``) over a
``ClusterView`` that its lifespan starts and stops; nothing here routes or changes anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest

from app.cluster.metrics import CONTENT_TYPE, ClusterMetrics
from app.cluster.view import ClusterView
from app.core.http import OrjsonResponse, OrjsonRoute, install_error_handlers
from app.dashboard.api import install
from app.dashboard.runtime import Dashboard
from app.dashboard.settings import DashboardSettings

__all__ = ["create_app"]


def create_app(settings: DashboardSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        if settings.redis_url is None:
            raise ValueError(
                "redis_url: the dashboard reads the workers' streams; give their Redis"
            )
        view = await ClusterView.connect(
            settings.redis_url, settings.view_config(), name="dashboard"
        )
        await view.start()
        dashboard = Dashboard.attach(view, view.workers_report, source="dashboard", decisions=False)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(
            ClusterMetrics(view, states=lambda: {w: m.state for w, m in view.members.items()})
        )
        app.state.view, app.state.dashboard, app.state.registry = view, dashboard, registry
        try:
            yield {}
        finally:
            await dashboard.aclose()
            await view.aclose()

    app = FastAPI(
        title="kvmesh dashboard",
        summary="A live view of the cluster's KV cache and its events (read-only)",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(_cluster_routes())
    install(app)
    return app


def _cluster_routes() -> APIRouter:
    router = APIRouter(tags=["cluster"], route_class=OrjsonRoute)

    @router.get("/workers", summary="Every worker: state, load, blocks per tier, heartbeat")
    async def workers(request: Request) -> Response:
        view: ClusterView = request.app.state.view
        return OrjsonResponse({"workers": view.workers_report()})

    @router.get("/index/stats", summary="The prefix index and the event consumer")
    async def index_stats(request: Request) -> Response:
        view: ClusterView = request.app.state.view
        return OrjsonResponse({"index": view.index.stats(), "consumer": view.consumer.stats()})

    @router.get("/health", summary="The process is up")
    async def health() -> Response:
        return OrjsonResponse({"status": "ok"})

    @router.get(
        "/ready",
        summary="Following the cluster: workers known, up, fresh and caught up (else 503)",
        responses={503: {"description": "not ready: the body lists the reasons"}},
    )
    async def ready(request: Request) -> Response:
        view: ClusterView = request.app.state.view
        members = view.members
        stale = {w: m.stale_reason for w, m in members.items() if m.stale_reason}
        fresh = sorted(w for w, m in members.items() if m.state == "up")
        body = view.readiness(fresh, stale)
        return OrjsonResponse(body, status_code=200 if body["ready"] else 503)

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        registry: CollectorRegistry = request.app.state.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    return router
