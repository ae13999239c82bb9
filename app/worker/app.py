"""The worker's FastAPI application and the process that serves it.

``create_app(settings)`` is the application; its lifespan owns a ``WorkerRuntime``, so nothing
is created at import time and tests run the whole worker in-process through httpx's
``ASGITransport``. ``serve(settings)`` runs it under uvicorn (uvloop, httptools) and handles
SIGTERM and SIGINT itself: stop admitting (503 with Retry-After), give in-flight requests
``drain_timeout_s``, abort the rest, flush the events, then let uvicorn exit. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from app.core.http import uvicorn_config
from app.core.http_protocol import OneWriteHttpToolsProtocol
from app.core.lifespan import runtime_lifespan
from app.worker.api import install
from app.worker.runtime import WorkerRuntime
from app.worker.settings import WorkerSettings

__all__ = ["create_app", "serve", "server_config"]

logger = logging.getLogger(__name__)


def create_app(settings: WorkerSettings, *, fast_path: bool = True) -> FastAPI:
    """The worker's app; ``fast_path=False`` leaves every completion to the FastAPI route."""
    app = FastAPI(
        title=f"kvmesh worker {settings.worker_id}",
        summary="One GPU's KV cache: OpenAI-compatible completions and the admin API",
        lifespan=runtime_lifespan(lambda: WorkerRuntime.start(settings)),
    )
    install(app, settings, fast_path=fast_path)
    return app


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT turned into a drain before the exit."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime: WorkerRuntime | None = getattr(self._app.state, "runtime", None)
        if self._draining is not None or runtime is None or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or not started: exit now
            if self._draining is not None:
                self.force_exit = True
            return
        logger.info("worker %s: %s received", runtime.settings.worker_id, signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain, runtime)

    def _start_drain(self, runtime: WorkerRuntime) -> None:
        async def drain_then_exit() -> None:
            try:
                await runtime.drain()
            finally:
                self.should_exit = True

        self._draining = asyncio.create_task(drain_then_exit(), name="kvmesh-drain")


def server_config(app: FastAPI, settings: WorkerSettings) -> uvicorn.Config:
    """How ``serve`` runs ``app``: as every service runs (``app.core.http``: the plain
    completions answered from the protocol), each answer in one write in any case
    (``app.core.http_protocol``: the fast routes' protocol writes so too)."""
    config = uvicorn_config(app, settings.host, settings.port, settings.log_level)
    if not isinstance(config.http, type):  # no fast routes: the plain protocol
        config.http = OneWriteHttpToolsProtocol
    return config


def serve(settings: WorkerSettings) -> None:
    """Run the worker until SIGTERM/SIGINT (blocking)."""
    app = create_app(settings)
    _Server(server_config(app, settings), app).run()
