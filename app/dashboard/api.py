"""The dashboard's HTTP side: the page, its assets, one frame as JSON, and the frame stream.

``GET /dashboard`` is the page (``app/dashboard/static/``, plain HTML, CSS and JavaScript
modules, no build step); ``GET /dashboard/state`` is one frame; ``GET /dashboard/stream`` is
server-sent events, one ``frame`` event per interval. Everything here is read-only, and nothing
in a frame needs or shows the admin token.

Frames come from the ``Dashboard`` of ``app.state.dashboard`` (``app.dashboard.runtime``); at
most ``max_clients`` streams at once, more get 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from app.core.http import OrjsonResponse, error
from app.dashboard.runtime import FrameHub

__all__ = ["install"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
_RETRY_MS = 2_000


def _frame_bytes(frame: dict[str, Any]) -> bytes:
    return (
        b"id: %d\nevent: frame\ndata: " % frame["feed"]["last_id"] + orjson.dumps(frame) + b"\n\n"
    )


def _routes() -> APIRouter:
    router = APIRouter(tags=["dashboard"])

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @router.get("/dashboard/state", summary="One dashboard frame (what the stream sends)")
    async def state(request: Request) -> Response:
        hub: FrameHub = request.app.state.dashboard.hub
        return OrjsonResponse(hub.frame(hub.build_shared(), None))

    @router.get(
        "/dashboard/stream",
        summary="Server-sent events: one dashboard frame per interval (read-only)",
        response_class=StreamingResponse,
    )
    async def stream(
        request: Request,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        hub: FrameHub = request.app.state.dashboard.hub
        if hub.clients >= hub.max_clients:
            return error(503, f"at most {hub.max_clients} dashboards at once", "unavailable_error")
        since = int(last_event_id) if last_event_id and last_event_id.isdigit() else None

        async def frames() -> AsyncIterator[bytes]:
            nonlocal since
            hub.clients += 1
            try:
                yield b"retry: %d\n\n" % _RETRY_MS
                while True:
                    shared = await hub.next_shared()
                    frame = hub.frame(shared, since)
                    since = frame["feed"]["last_id"]
                    yield _frame_bytes(frame)
            finally:
                hub.clients -= 1

        return StreamingResponse(
            frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router


def install(app: FastAPI) -> None:
    app.include_router(_routes())
    # check_dir off: a package installed without its page still routes (the page is a 404).
    app.mount(
        "/dashboard/static",
        StaticFiles(directory=STATIC_DIR, check_dir=False),
        name="dashboard-static",
    )
