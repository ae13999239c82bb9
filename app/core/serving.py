"""Running a service's app under uvicorn until SIGTERM or SIGINT, exiting with status 0.

uvicorn re-raises the signal it stopped on, so the process would end killed by it (status
-15); a service that was asked to stop and stopped cleanly exits 0 instead. The worker has its
own server (a drain comes first); the router and the dashboard use this one.
"""

from __future__ import annotations

import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.core.http import uvicorn_config

__all__ = ["serve"]


def serve(
    app: FastAPI, host: str, port: int, log_level: str, sock: socket.socket | None = None
) -> None:
    """Run ``app`` until SIGTERM/SIGINT (blocking); on ``sock`` (a listening socket another
    process bound: ``app.core.replicas``) instead of binding ``host:port`` when given."""
    config = uvicorn_config(app, host, port, log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    _Server(config).run(sockets=[sock] if sock is not None else None)


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
