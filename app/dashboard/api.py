"""The dashboard's HTTP side: the page, its assets, one frame as JSON, and the frame stream.

``GET /dashboard`` is the page (``app/dashboard/static/``, plain HTML, CSS and JavaScript
modules, no build step); ``GET /dashboard/state`` is one frame; ``GET /dashboard/stream`` is
server-sent events, one ``frame`` event per interval. Everything here is read-only, and nothing
in a frame needs or shows the admin token.

``FrameHub`` builds the shared part of a frame once per interval, and only while a browser is
connected; each connection then adds the feed items it has not seen. A slow browser is never
queued for: each connection sends the newest frame when its previous send has finished, so it
gets fewer frames, and the consumer and the router never wait for it. The event id of a frame
is the id of its newest feed item, so a reconnecting browser (``Last-Event-ID``) gets the items
it missed if they are still in the ring, else a fresh full state. At most ``max_clients``
streams at once; more get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from app.core.http import OrjsonResponse, error

if TYPE_CHECKING:
    from app.router.service import RouterRuntime

__all__ = ["FrameHub", "install"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
_RETRY_MS = 2_000


class FrameHub:
    """Builds frames for every connected browser; see the module docstring."""

    def __init__(self, runtime: RouterRuntime, *, max_clients: int = 64) -> None:
        self.runtime = runtime
        self.max_clients = max_clients
        self.clients = 0
        self.seq = 0
        self._shared: dict[str, Any] | None = None
        self._tick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvmesh-dashboard-frames")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.runtime.dashboard.interval_s
        while True:
            if self.clients:
                self._shared = self.build_shared()
                tick, self._tick = self._tick, asyncio.Event()
                tick.set()
            await asyncio.sleep(interval)

    async def next_shared(self) -> dict[str, Any]:
        await self._tick.wait()
        assert self._shared is not None
        return self._shared

    def build_shared(self) -> dict[str, Any]:
        """Everything in a frame but the feed (the same for every browser)."""
        runtime = self.runtime
        state = runtime.dashboard
        self.seq += 1
        workers = worker_rows(runtime)
        names = [row["worker"] for row in workers]
        consumer = runtime.consumer.stats()
        return {
            "seq": self.seq,
            "t": round(state.clock(), 3),
            "interval_s": state.interval_s,
            "source": runtime.source,
            "workers": workers,
            "rates": state.rates(names),
            "decisions": state.decisions(),
            "prefixes": state.prefixes(runtime.index, names),
            "consumer": consumer,
        }

    def frame(self, shared: dict[str, Any], last_feed_id: int | None) -> dict[str, Any]:
        items, newest = self.runtime.dashboard.feed_since(last_feed_id)
        return {
            **shared,
            "feed": {
                "items": items,
                "skipped": self.runtime.dashboard.num_skipped,
                "last_id": newest,
            },
        }


def worker_rows(runtime: RouterRuntime) -> list[dict[str, Any]]:
    """Per worker: state, blocks per tier, hit rate, requests, heartbeat and lag."""
    rows = []
    states = runtime.consumer.workers()
    for entry in runtime.workers_report():
        load: dict[str, int] = entry.get("load") or {}
        state = states.get(entry["worker"])
        capacity = (state.info.get("capacity") if state is not None else None) or [0, 0]
        reused, computed = load.get("reused_tokens", 0), load.get("computed_tokens", 0)
        cordon = entry.get("cordon")
        rows.append(
            {
                "worker": entry["worker"],
                # A drain an operator asked for is "drained" once nothing is left in flight.
                "state": "drained" if cordon and cordon.get("done") else entry["state"],
                "cordon": cordon,
                "stale_reason": entry.get("stale_reason"),
                "url": entry.get("url"),
                "heartbeat_age_s": entry.get("heartbeat_age_s"),
                "lag_ms": entry.get("lag_ms", 0.0),
                "running": load.get("running_requests", load.get("active_sequences", 0)),
                "waiting": load.get("waiting_requests", 0),
                "decisions": entry.get("decisions", 0),
                "hit_rate": round(reused / (reused + computed), 4) if reused + computed else None,
                "gpu": _tier(capacity, 0, load, entry["blocks"]["gpu"]),
                "host": _tier(capacity, 1, load, entry["blocks"]["host"]),
            }
        )
    return rows


def _tier(capacity: list[Any], level: int, load: dict[str, int], cached: int) -> dict[str, int]:
    total = int(capacity[level]) if len(capacity) > level else 0
    used = load.get(f"used_blocks_{level}", 0)
    return {
        "capacity": total,
        "used": used,
        "cached": cached,
        "free": max(total - used - cached, 0),
    }


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
        hub: FrameHub = request.app.state.runtime.hub
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
        hub: FrameHub = request.app.state.runtime.hub
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
