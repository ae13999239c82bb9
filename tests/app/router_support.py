"""Helpers for the router tests: settings, an in-process router behind httpx, what its index
holds (the generic pieces are in ``tests.support``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import httpx

from app.router.runtime import RouterRuntime
from app.router.settings import RouterSettings
from app.services import router_app
from tests.app.worker_support import ADMIN_TOKEN
from tests.support.asgi import asgi_client


def router_settings(redis_url: str, **overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "admin_token": ADMIN_TOKEN,
        "sync_interval_s": 0.02,
        "load_interval_s": 0.05,
    }
    values.update(overrides)
    return RouterSettings(**values)


def router_client(
    settings: RouterSettings,
) -> contextlib.AbstractAsyncContextManager[tuple[httpx.AsyncClient, RouterRuntime]]:
    """The router app inside its lifespan, spoken to through httpx's ASGITransport."""
    return asgi_client(router_app(settings), "http://router")


def index_holds(runtime: RouterRuntime, worker: str, num_blocks: int) -> Callable[[], bool]:
    def check() -> bool:
        per_worker = runtime.index.stats()["per_worker"]
        return per_worker.get(worker, {}).get("blocks", 0) == num_blocks

    return check
