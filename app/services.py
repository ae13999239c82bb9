"""What each ``kvmesh`` command serves, composed here from services that never import each
other: the router with its dashboard beside it (``router_app``), and the dashboard on its own
(``dashboard_app``). The worker is one service alone (``app.worker.app.create_app``).

The dashboard rides on the router as an extension (``app.router.app.Extension``): started with
the router's runtime, it follows the same ``ClusterView``, shows the router's ``/workers``
entries, and records its decisions through the runtime's decision hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from app.dashboard.api import install as install_dashboard
from app.dashboard.app import create_app as create_dashboard_app
from app.dashboard.runtime import Dashboard
from app.dashboard.settings import DashboardSettings
from app.router.app import create_app as create_router_app
from app.router.runtime import RouterRuntime
from app.router.settings import RouterSettings

__all__ = ["dashboard_app", "router_app"]


def router_app(settings: RouterSettings) -> FastAPI:
    """``kvmesh router``: the router, and its dashboard at ``/dashboard``."""
    app = create_router_app(settings, extensions=[_dashboard_beside])
    install_dashboard(app)
    return app


def dashboard_app(settings: DashboardSettings) -> FastAPI:
    """``kvmesh dashboard``: the dashboard alone, read-only."""
    return create_dashboard_app(settings)


@contextlib.asynccontextmanager
async def _dashboard_beside(app: FastAPI, runtime: RouterRuntime) -> AsyncIterator[None]:
    dashboard = Dashboard.attach(
        runtime.view, runtime.workers_report, source="router", decisions=True
    )
    runtime.decision_hooks.append(dashboard.state.on_decision)
    app.state.dashboard = dashboard
    try:
        yield
    finally:
        runtime.decision_hooks.remove(dashboard.state.on_decision)
        await dashboard.aclose()
