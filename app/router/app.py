"""The router's FastAPI application, built from its settings, and the process that serves it.

``create_app(settings, extensions=...)`` builds the routes (``app.router.api``) and a lifespan
that starts a ``RouterRuntime`` (and stops it), so nothing is created at import time and tests
run the whole router in-process through httpx's ``ASGITransport``. An *extension* is something
else served beside the router on the same runtime, started with it: ``app.services`` adds the
dashboard that way, so that the router never imports the dashboard (``app.core.serving`` runs
it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI

from app.core.lifespan import runtime_lifespan
from app.router.api import install
from app.router.runtime import RouterRuntime
from app.router.settings import RouterSettings

__all__ = ["Extension", "create_app"]

# Started with the runtime, stopped before it: (the app, the runtime) -> its lifetime.
Extension = Callable[[FastAPI, RouterRuntime], AbstractAsyncContextManager[None]]


def create_app(settings: RouterSettings, *, extensions: Sequence[Extension] = ()) -> FastAPI:
    """The router's app; see the module docstring."""

    app = FastAPI(
        title="kvmesh router",
        summary="Cache-aware, load-aware placement of LLM requests across kvmesh workers",
        lifespan=runtime_lifespan(lambda: RouterRuntime.start(settings), extensions),
    )
    install(app, settings)
    return app
