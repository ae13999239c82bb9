"""The dashboard's running part: what it aggregates (``DashboardState``), fed by a
``ClusterView``'s entries and, beside a router, by its decisions; and ``FrameHub``, which builds
the frames the page shows.

``FrameHub`` builds the shared part of a frame once per interval, and only while a browser is
connected; each connection then adds the feed items it has not seen. A slow browser is never
queued for: each connection sends the newest frame when its previous send has finished, so it
gets fewer frames, and the consumer and the router never wait for it. The event id of a frame
is the id of its newest feed item, so a reconnecting browser (``Last-Event-ID``) gets the items
it missed if they are still in the ring, else a fresh full state.

``Dashboard.attach(view, ...)`` wires it to a view (and starts the frame task); ``aclose``
unwires and stops it. Which worker rows it shows comes from ``reports`` (``GET /workers``'s
entries of whatever serves it: the router's, or the view's alone for ``kvmesh dashboard``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from app.cluster.view import ClusterView
from app.dashboard.state import DashboardState

__all__ = ["Dashboard", "FrameHub", "Reports", "worker_rows"]

Reports = Callable[[], list[dict[str, Any]]]


class Dashboard:
    """One dashboard on one view: its state and its frame hub."""

    def __init__(
        self, view: ClusterView, reports: Reports, *, source: str, decisions: bool
    ) -> None:
        self.view = view
        self.state = DashboardState(record_decisions=decisions)
        self.hub = FrameHub(view, self.state, reports, source=source)

    @classmethod
    def attach(
        cls, view: ClusterView, reports: Reports, *, source: str, decisions: bool
    ) -> Dashboard:
        dashboard = cls(view, reports, source=source, decisions=decisions)
        view.entry_hooks.append(dashboard.state.on_entry)
        dashboard.hub.start()
        return dashboard

    async def aclose(self) -> None:
        await self.hub.aclose()
        with contextlib.suppress(ValueError):
            self.view.entry_hooks.remove(self.state.on_entry)


class FrameHub:
    """Builds frames for every connected browser; see the module docstring."""

    def __init__(
        self,
        view: ClusterView,
        state: DashboardState,
        reports: Reports,
        *,
        source: str,
        max_clients: int = 64,
    ) -> None:
        self.view = view
        self.state = state
        self.reports = reports
        self.source = source
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
        interval = self.state.interval_s
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
        state = self.state
        self.seq += 1
        workers = worker_rows(self.reports(), self.view)
        names = [row["worker"] for row in workers]
        consumer = self.view.consumer.stats()
        return {
            "seq": self.seq,
            "t": round(state.clock(), 3),
            "interval_s": state.interval_s,
            "source": self.source,
            "workers": workers,
            "rates": state.rates(names),
            "decisions": state.decisions(),
            "prefixes": state.prefixes(self.view.index, names),
            "consumer": consumer,
        }

    def frame(self, shared: dict[str, Any], last_feed_id: int | None) -> dict[str, Any]:
        items, newest = self.state.feed_since(last_feed_id)
        return {
            **shared,
            "feed": {
                "items": items,
                "skipped": self.state.num_skipped,
                "last_id": newest,
            },
        }


def worker_rows(reports: list[dict[str, Any]], view: ClusterView) -> list[dict[str, Any]]:
    """Per worker (``reports``: ``GET /workers``'s entries): state, blocks per tier, hit rate,
    requests, heartbeat and lag."""
    rows = []
    states = view.consumer.workers()
    for entry in reports:
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
