"""Running a service's app under uvicorn until SIGTERM or SIGINT, exiting with status 0.

uvicorn re-raises the signal it stopped on, so the process would end killed by it (status
-15); a service that was asked to stop and stopped cleanly exits 0 instead. The worker has its
own server (a drain comes first); the router and the dashboard use this one.

Once started, a service's heap is settled (``settle_heap``): what start-up built lives as long
as the process, and Python's cyclic collector would otherwise walk it all on every full pass.
"""

from __future__ import annotations

import gc
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.core.http import uvicorn_config

__all__ = ["serve", "settle_heap"]

# Net allocations between two young-generation collections (Python's default: 700): fewer
# collections while the worker's engine allocates per step.
_YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """Collect once, then freeze what is left out of every later collection: the imports
    (torch, numba, FastAPI), the worker's pool of blocks and their keys, all kept until exit.
    The router's imports alone are 277k tracked objects: a full collection walked them for
    67-132 ms (measured in ``kvmesh bench router``'s router while it caught up), a stall of
    every request in flight; frozen, they cost a full collection nothing."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_YOUNG_THRESHOLD, 10, 10)


def serve(
    app: FastAPI, host: str, port: int, log_level: str, sock: socket.socket | None = None
) -> None:
    """Run ``app`` until SIGTERM/SIGINT (blocking); on ``sock`` (a listening socket another
    process bound: ``app.core.replicas``) instead of binding ``host:port`` when given."""
    config = uvicorn_config(app, host, port, log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    _Server(config).run(sockets=[sock] if sock is not None else None)


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        settle_heap()  # after the lifespan: the runtime's start-up is in it

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
