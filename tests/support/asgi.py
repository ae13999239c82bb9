"""A service's FastAPI app inside its lifespan, spoken to through httpx's ASGI transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from app.core.http import front_of

__all__ = ["asgi_client"]


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI, base_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app's lifespan runs around the client, which talks to what a server runs (its fast
    path in front, where it has one: ``app.core.http.front_of``); yields the client and the
    runtime the lifespan made (``app.state.runtime``)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=front_of(app))  # as a server runs it
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield client, app.state.runtime
