"""A service's FastAPI app inside its lifespan, spoken to through httpx's ASGI transport, or
under a real uvicorn server configured as the services run it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from app.core.http import front_of, uvicorn_config
from app.core.net import free_port
from tests.support.wait import eventually

__all__ = ["asgi_client", "served"]


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI, base_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app's lifespan runs around the client, which talks to what a server runs (its fast
    path in front, where it has one: ``app.core.http.front_of``); yields the client and the
    runtime the lifespan made (``app.state.runtime``)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=front_of(app))  # as a server runs it
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield client, app.state.runtime


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[str]:
    """``app`` under a real uvicorn server, configured as ``kvmesh router`` and ``kvmesh
    worker`` run it (its fast routes in the server's protocol included); yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started or task.done())
        if task.done():  # it could not start (the port taken meanwhile, say): say why
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
